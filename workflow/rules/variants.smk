# Seeds and sweeps (rloo_workflow.pipeline.Variant): the chain's rules again (`<rule>_variant`) for one variant,
# a seed of the `seeds` target or a point of a sweep, named by its folder: the wildcard `variant`,
# seeds/seed<N> or sweeps/<sweep>/<point id> (rloo_workflow.pipeline: VARIANT_FOLDERS; parse_variant reads the
# seed or point back from it). The same inputs, params, commands, resources and environment (`use rule`:
# the chain rules read the job's variant off its wildcards, workflow/rules/common.smk), their outputs,
# logs and work folders below that folder, so that each runs, and resumes, as a job of its own. A job
# reads the main chain's outputs for the stages its variant does not change (rloo_workflow.pipeline.job_inputs),
# so only the changed stages and what follows them run per seed or point. The aggregates: the `seeds`
# and `sweep` rules (workflow/rules/seeds.smk, sweeps.smk), on SEED_RESULTS and sweep_results.
# Helpers: workflow/rules/variant_helpers.smk.

use rule prepare as prepare_variant with:
    output:
        **VARIANT_OUT["prepare"],
    log:
        f"{LOGS}/{VARIANT}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/prepare.tsv"


use rule base as base_variant with:
    output:
        model=directory(VARIANT_OUT["base"]["model"]),
    log:
        f"{LOGS}/{VARIANT}/base.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/base.tsv"


use rule sft as sft_variant with:
    output:
        model=directory(VARIANT_OUT["sft"]["model"]),
    log:
        f"{LOGS}/{VARIANT}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/sft.tsv"


use rule reward as reward_variant with:
    output:
        model=directory(VARIANT_OUT["reward"]["model"]),
    log:
        f"{LOGS}/{VARIANT}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/reward.tsv"


use rule rloo as rloo_variant with:
    output:
        model=directory(VARIANT_OUT["rloo"]["model"]),
    log:
        f"{LOGS}/{VARIANT}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_variant with:
    output:
        **VARIANT_OUT["evaluate"],
    log:
        f"{LOGS}/{VARIANT}/evaluate_{{policy}}.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/evaluate_{{policy}}.tsv"


use rule judge as judge_variant with:
    output:
        **VARIANT_OUT["judge"],
    log:
        stage=f"{LOGS}/{VARIANT}/judge_{ESTIMATOR}.log",
        judge=f"{LOGS}/{VARIANT}/judge_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/judge_{ESTIMATOR}.tsv"


use rule report as report_variant with:
    output:
        **VARIANT_OUT["report"],
    log:
        f"{LOGS}/{VARIANT}/report_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/report_{ESTIMATOR}.tsv"
