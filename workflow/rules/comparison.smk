rule comparison:
    input:
        # each estimator's report, and its evaluation's records (judged against RLOO's)
        unpack(guarded(OUT["comparison"].values(), {
            "results": expand(OUT["report"]["result"], estimator=COMPARED),
            "records": expand(OUT["evaluate"]["records"], policy=COMPARED)})),
        **LOCAL_INPUTS["comparison"],
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
        args=lambda wildcards, input, output: aggregate_args("comparison", output,
                                                             dict(zip(COMPARED, input.results, strict=True)),
                                                             records=dict(zip(COMPARED, input.records, strict=True))),
    conda:
        RLOO_ENV
    log:
        stage=LOG["comparison"]["log"],
        judge=LOG["comparison"]["judge_log"],
    benchmark:
        LOG["comparison"]["benchmark"]
    threads: 1
    resources:
        **judge_resources(),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo comparison @{params.args} --log {log.stage}"
