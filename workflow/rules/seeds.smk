# The seeds target: every seed of `seeds.values` through the chain (workflow/rules/variants.smk; which
# stages run per seed: `seeds.scope`), then their results side by side with a t-interval across seeds.
rule seeds:
    input:
        unpack(guarded(outputs("seeds", config).values(), {"results": list(SEED_RESULTS.values())})),
    output:
        result=outputs("seeds", config)["result"],
        plot=report(outputs("seeds", config)["plot"], caption="../report/seeds.rst", category="Seeds"),
    params:
        code=code("seeds"),
        cfg=lambda wildcards: stage_config("seeds"),
        args=lambda wildcards, output: aggregate_args("seeds", output, SEED_RESULTS),
    conda:
        RLOO_ENV
    log:
        LOG["seeds"]["log"],
    benchmark:
        LOG["seeds"]["benchmark"]
    threads: 1
    shell:
        "rloo seeds @{params.args} --log {log}"
