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
        VARIANT_LOG["prepare"]["log"],
    benchmark:
        VARIANT_LOG["prepare"]["benchmark"]


use rule base as base_variant with:
    output:
        model=directory(VARIANT_OUT["base"]["model"]),
    log:
        VARIANT_LOG["base"]["log"],
    benchmark:
        VARIANT_LOG["base"]["benchmark"]


use rule sft as sft_variant with:
    output:
        model=directory(VARIANT_OUT["sft"]["model"]),
    log:
        VARIANT_LOG["sft"]["log"],
    benchmark:
        VARIANT_LOG["sft"]["benchmark"]


use rule reward as reward_variant with:
    output:
        model=directory(VARIANT_OUT["reward"]["model"]),
    log:
        VARIANT_LOG["reward"]["log"],
    benchmark:
        VARIANT_LOG["reward"]["benchmark"]


use rule rloo as rloo_variant with:
    output:
        model=directory(VARIANT_OUT["rloo"]["model"]),
    log:
        VARIANT_LOG["rloo"]["log"],
    benchmark:
        VARIANT_LOG["rloo"]["benchmark"]


use rule evaluate as evaluate_variant with:
    output:
        **VARIANT_OUT["evaluate"],
    log:
        VARIANT_LOG["evaluate"]["log"],
    benchmark:
        VARIANT_LOG["evaluate"]["benchmark"]


use rule judge as judge_variant with:
    output:
        **VARIANT_OUT["judge"],
    log:
        stage=VARIANT_LOG["judge"]["log"],
        judge=VARIANT_LOG["judge"]["judge_log"],
    benchmark:
        VARIANT_LOG["judge"]["benchmark"]


use rule report as report_variant with:
    output:
        **VARIANT_OUT["report"],
    log:
        VARIANT_LOG["report"]["log"],
    benchmark:
        VARIANT_LOG["report"]["benchmark"]
