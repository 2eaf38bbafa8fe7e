rule sft:
    input:
        unpack(chain_inputs("sft")),
    output:
        model=directory(OUT["sft"]["model"]),
    params:
        cfg=chain_cfg("sft"),
        identity=chain_identity("sft"),
        args=chain_args("sft"),
    conda:
        RLOO_ENV
    log:
        LOG["sft"]["log"],
    benchmark:
        LOG["sft"]["benchmark"]
    threads: TORCH_THREADS
    resources:
        **cluster_resources("sft"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo sft @{params.args} --set threads={threads} --log {log}"
