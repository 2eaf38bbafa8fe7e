rule reward:
    input:
        train=rules.prepare.output.train,
        policy=rules.sft.output.model,
        # reward.init when it is a local folder
        start=local_inputs(config["reward"]["init"]),
    output:
        model=directory(OUT["reward"]["model"]),
    params:
        code=code("reward"),
        cfg=lambda wildcards: stage_config("reward"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=work_dir("reward", config),
        variant=NO_VARIANT,
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/reward.tsv"
    threads: TORCH_THREADS
    resources:
        **gpu_resources("reward"),
        mem_mb=32000,
        runtime=120,
        cpus_per_task=cpus,
    shell:
        "python {params.guard} {params.work} {params.cfg:q} {params.code} {input} > {log} 2>&1 && "
        "rloo reward --config-json {params.cfg:q} {params.variant} --set threads={threads} "
        "--data {params.data} --policy {input.policy} --out {output.model} --work {params.work} 2>> {log}"
