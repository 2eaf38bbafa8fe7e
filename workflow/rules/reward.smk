rule reward:
    input:
        unpack(chain_inputs("reward")),
        # reward.init when it is a local folder
        start=local_inputs(SETTINGS.reward.init),
    output:
        model=directory(OUT["reward"]["model"]),
    params:
        code=code("reward"),
        cfg=chain_cfg("reward"),
        lineage=chain_lineage("reward"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=chain_work("reward"),
        variant=variant_arg,
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
        "python {params.guard} {params.work} {params.cfg} {params.code} {input} > {log} 2>&1 && "
        "rloo reward --job-config {params.cfg} {params.variant} --set threads={threads} "
        "--data {params.data} --policy {input.policy} --out {output.model} --work {params.work} --log {log}"
