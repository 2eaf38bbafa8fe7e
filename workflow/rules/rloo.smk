rule rloo:
    input:
        unpack(reward_model),
        code=code("train"),
        reward_code=reward_code,
        train=rules.prepare.output.train,
        val=rules.prepare.output.val,
        policy=rules.sft.output.model,
    output:
        model=directory(OUT["rloo"]["model"]),
    params:
        cfg=lambda wildcards: stage_config("rloo", {"rloo.estimator": wildcards.estimator}),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=lambda wildcards: work_dir("rloo", config, wildcards.estimator),
        reward_model=reward_model_arg,
        variant=NO_VARIANT,
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/rloo_{{estimator}}.log",
    benchmark:
        f"{LOGS}/benchmarks/rloo_{{estimator}}.tsv"
    threads: TORCH_THREADS
    resources:
        **gpu_resources("rloo"),
        mem_mb=32000,
        runtime=480,
        cpus_per_task=cpus,
    shell:
        "python {params.guard} {params.work} {params.cfg:q} {input} > {log} 2>&1 && "
        "rloo train --config-json {params.cfg:q} {params.variant} --set threads={threads} "
        "--data {params.data} --policy {input.policy} {params.reward_model} "
        "--out {output.model} --work {params.work} 2>> {log} && "
        "rloo summary {output.model}/metrics.json"
