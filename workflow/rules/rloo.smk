rule rloo:
    input:
        unpack(chain_inputs("rloo")),
    output:
        model=directory(OUT["rloo"]["model"]),
    params:
        cfg=chain_cfg("rloo"),
        identity=chain_identity("rloo"),
        args=chain_args("rloo"),
    conda:
        RLOO_ENV
    log:
        LOG["rloo"]["log"],
    benchmark:
        LOG["rloo"]["benchmark"]
    threads: TORCH_THREADS
    # the longest path (RLOO, its evaluation, the report) starts first: base's and SFT's evaluations,
    # ready at the same time, fill the cores beside it; and a rerun's first error is the training's
    priority: 1
    resources:
        **cluster_resources("rloo"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo train @{params.args} --set threads={threads} --log {log}"
