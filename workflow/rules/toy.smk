rule toy:
    output:
        result=OUT["toy"]["result"],
        plot=report(
            OUT["toy"]["plot"],
            caption="../report/toy_variance.rst",
            category="Toy variance experiment",
        ),
    params:
        code=code("toy"),
        cfg=lambda wildcards: stage_config("toy"),
        args=lambda wildcards, output: aggregate_args("toy", output),
    conda:
        RLOO_ENV
    log:
        LOG["toy"]["log"],
    benchmark:
        LOG["toy"]["benchmark"]
    threads: 1
    shell:
        "rloo toy @{params.args} --log {log}"
