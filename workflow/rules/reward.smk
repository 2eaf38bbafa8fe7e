rule reward:
    input:
        unpack(chain_inputs("reward")),
        # reward.init when it is a local folder
        start=local_inputs(SETTINGS.reward.init),
    output:
        model=directory(OUT["reward"]["model"]),
    params:
        cfg=chain_cfg("reward"),
        identity=chain_identity("reward"),
        args=chain_args("reward"),
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/reward.tsv"
    threads: TORCH_THREADS
    resources:
        **cluster_resources("reward"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo reward @{params.args} --set threads={threads} --log {log}"
