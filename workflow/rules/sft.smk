rule sft:
    input:
        train=rules.prepare.output.train,
        test=rules.prepare.output.test,
        base=rules.base.output.model,
    output:
        model=directory(OUT["sft"]["model"]),
    params:
        code=code("sft"),
        cfg=lambda wildcards: stage_config("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=work_dir("sft", config),
        variant=NO_VARIANT,
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/sft.tsv"
    threads: TORCH_THREADS
    resources:
        **gpu_resources("sft"),
        mem_mb=32000,
        runtime=240,
        cpus_per_task=cpus,
    shell:
        "python {params.guard} {params.work} {params.cfg:q} {params.code} {input} > {log} 2>&1 && "
        "rloo sft --config-json {params.cfg:q} {params.variant} --set threads={threads} "
        "--data {params.data} --base {input.base} --out {output.model} --work {params.work} 2>> {log}"
