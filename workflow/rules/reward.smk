rule reward:
    input:
        unpack(chain_inputs("reward")),
        # reward.init when it is a local folder
        **LOCAL_INPUTS["reward"],
    output:
        model=directory(OUT["reward"]["model"]),
    params:
        cfg=chain_cfg("reward"),
        identity=chain_identity("reward"),
        args=chain_args("reward"),
    conda:
        RLOO_ENV
    log:
        LOG["reward"]["log"],
    benchmark:
        LOG["reward"]["benchmark"]
    threads: TORCH_THREADS
    resources:
        **cluster_resources("reward"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo reward @{params.args} --set threads={threads} --log {log}"
