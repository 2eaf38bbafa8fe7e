rule sft:
    input:
        unpack(chain_inputs("sft")),
    output:
        model=directory(OUT["sft"]["model"]),
    params:
        code=code("sft"),
        cfg=chain_cfg("sft"),
        lineage=chain_lineage("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=chain_work("sft"),
        variant=variant_arg,
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/sft.tsv"
    threads: TORCH_THREADS
    resources:
        **cluster_resources("sft"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "python {params.guard} {params.work} {params.cfg} {params.code} {input} > {log} 2>&1 && "
        "rloo sft --job-config {params.cfg} {params.variant} --set threads={threads} "
        "--data {params.data} --base {input.base} --out {output.model} --work {params.work} --log {log}"
