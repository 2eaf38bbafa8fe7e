rule sft:
    input:
        unpack(chain_inputs("sft")),
    output:
        model=directory(OUT["sft"]["model"]),
    params:
        cfg=chain_cfg("sft"),
        identity=chain_identity("sft"),
        args=job_args("sft", "--job-config {cfg} {variant} --data {data} --base {input.base} --out {output.model} "
                      "--work {work} --work-guard", cfg=chain_cfg("sft"), variant=variant_arg, data=data_dir,
                      work=chain_work("sft")),
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
        "rloo sft @{params.args} --set threads={threads} --log {log}"
