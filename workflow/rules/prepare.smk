rule prepare:
    input:
        # data.source=jsonl: the local files are inputs too (replacing one reruns prepare)
        files=local_inputs(SETTINGS.data.train_file, SETTINGS.data.test_file)
        if SETTINGS.data.source == "jsonl"
        else [],
    output:
        **OUT["prepare"],
    params:
        cfg=chain_cfg("prepare"),
        identity=chain_identity("prepare"),
        args=chain_args("prepare"),
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/prepare.tsv"
    threads: 1
    shell:
        "rloo prepare @{params.args} --log {log}"
