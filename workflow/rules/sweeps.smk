# A sweep's target, results/sweeps/<name>.json: every point of the grid `sweeps.<name>` through the
# stages it changes (workflow/rules/variants.smk), then one table: the best point by validation accuracy
# and its margin over the runner-up, or a tie.
rule sweep:
    input:
        unpack(guarded(OUT["sweep"].values(), lambda wildcards: {"results": list(sweep_results(wildcards.sweep).values())})),
    output:
        result=OUT["sweep"]["result"],
        plot=report(OUT["sweep"]["plot"], caption="../report/sweep.rst", category="Sweeps",
                    subcategory="{sweep}", labels={"sweep": "{sweep}"}),
    params:
        code=code("sweep"),
        cfg=lambda wildcards: stage_config("sweep"),
        args=lambda wildcards, output: aggregate_args("sweep", output, sweep_results(wildcards.sweep), sweep=wildcards.sweep),
    conda:
        RLOO_ENV
    log:
        # each point's report appends its line as it ends (rloo_workflow.sweep_table.log_path, the same file);
        # Snakemake empties it as this job starts, which then writes every point's line and the winner
        LOG["sweep"]["log"],
    benchmark:
        LOG["sweep"]["benchmark"]
    threads: 1
    shell:
        "rloo sweep @{params.args} --log {log}"
