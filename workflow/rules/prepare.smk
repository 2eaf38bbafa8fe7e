rule prepare:
    input:
        # data.source=jsonl: the local files are inputs too (replacing one reruns prepare)
        **LOCAL_INPUTS["prepare"],
    output:
        **OUT["prepare"],
    params:
        cfg=chain_cfg("prepare"),
        identity=chain_identity("prepare"),
        args=chain_args("prepare"),
    conda:
        RLOO_ENV
    log:
        LOG["prepare"]["log"],
    benchmark:
        LOG["prepare"]["benchmark"]
    threads: 1
    shell:
        "rloo prepare @{params.args} --log {log}"
