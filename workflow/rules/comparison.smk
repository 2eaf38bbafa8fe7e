rule comparison:
    input:
        # each estimator's report, and its evaluation's records (judged against RLOO's)
        unpack(guarded(OUT["comparison"].values(), {
            "results": expand(OUT["report"]["result"], estimator=COMPARED),
            "records": expand(OUT["evaluate"]["records"], policy=COMPARED)})),
        judge=JUDGE_MODEL,
    output:
        result=OUT["comparison"]["result"],
        plot=report(
            OUT["comparison"]["plot"],
            caption="../report/comparison.rst",
            category="Estimator comparison",
        ),
    params:
        code=code("comparison"),
        cfg=lambda wildcards: stage_config("comparison"),
        # the judge's output goes to `rloo comparison`'s default, log.judge: the command stays one short line
        args=job_args(
            "comparison", "--job-config {cfg} {results} {timings} --out {output.result} --plot {output.plot}",
            cfg=lambda wildcards: stage_config("comparison"),
            results=lambda input: " ".join(
                f"--result {e}={f} --records {e}={r}" for e, f, r in zip(COMPARED, input.results, input.records, strict=True)
            ),
            # wall-clock figures of the RLOO runs: beside their checkpoints, not in any output
            timings=" ".join(f"--timings {e}={work_dir('rloo', config, e)}/timings.json" for e in COMPARED)),
    conda:
        RLOO_ENV
    log:
        stage=f"{LOGS}/comparison.log",
        judge=f"{LOGS}/comparison.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/comparison.tsv"
    threads: 1
    resources:
        **judge_resources(),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo comparison @{params.args} --log {log.stage}"
