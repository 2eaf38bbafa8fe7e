rule rloo:
    input:
        unpack(chain_inputs("rloo")),
    output:
        model=directory(OUT["rloo"]["model"]),
    params:
        code=code("rloo"),
        cfg=chain_cfg("rloo"),
        lineage=chain_lineage("rloo"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=chain_work("rloo"),
        reward_model=reward_model_arg,
        variant=variant_arg,
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/rloo_{{estimator}}.log",
    benchmark:
        f"{LOGS}/benchmarks/rloo_{{estimator}}.tsv"
    threads: TORCH_THREADS
    # the longest path (RLOO, its evaluation, the report) starts first: base's and SFT's evaluations,
    # ready at the same time, fill the cores beside it; and a rerun's first error is the training's
    priority: 1
    resources:
        **cluster_resources("rloo"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "python {params.guard} {params.work} {params.cfg} {params.code} {input} > {log} 2>&1 && "
        "rloo train --job-config {params.cfg} {params.variant} --set threads={threads} "
        "--data {params.data} --policy {input.policy} {params.reward_model} "
        "--out {output.model} --work {params.work} --log {log} && "
        "rloo summary {output.model}/metrics.json"
