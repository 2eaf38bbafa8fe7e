rule reward:
    input:
        code=code("reward"),
        train=rules.prepare.output.train,
        policy=rules.sft.output.model,
        # reward.init when it is a local folder
        start=local_inputs(config["reward"]["init"]),
    output:
        model=directory(f"{MODELS}/reward"),
    params:
        cfg=lambda wildcards: stage_config("reward"),
        data=data_dir,
    log:
        f"{LOGS}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/reward.tsv"
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=32000,
        runtime=120,
        cpus_per_task=cpus,
    shell:
        "rloo reward --config-json {params.cfg:q} --set threads={threads} "
        "--data {params.data} --policy {input.policy} --out {output.model} 2> {log}"
