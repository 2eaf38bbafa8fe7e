# Seeds and sweeps (rloo.pipeline.Variant): the chain's rules again (`<rule>_variant`) for one variant,
# a seed of the `seeds` target or a point of a sweep, named by its folder: the wildcard `variant`,
# seeds/seed<N> or sweeps/<sweep>/<point id> (rloo.pipeline: VARIANT_FOLDERS; parse_variant reads the
# seed or point back from it). The same commands, resources and environment (`use rule`), their
# outputs, logs and work folders below that folder, so that each runs, and resumes, as a job of its
# own. A job reads the main chain's outputs for the stages its variant does not change (v_input), so
# only the changed stages and what follows them run per seed or point. The aggregates: the `seeds`
# and `sweep` rules (workflow/rules/seeds.smk, sweeps.smk), on SEED_RESULTS and sweep_results.
# Helpers: workflow/rules/variant_helpers.smk.

use rule prepare as prepare_variant with:
    input:
        code=code("prepare"),
        files=rules.prepare.input.files,
    output:
        **VARIANT_OUT["prepare"],
    params:
        cfg=v_cfg("prepare"),
        out=lambda wildcards, output: os.path.dirname(output.manifest),
        variant=v_label,
    log:
        f"{LOGS}/{VARIANT}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/prepare.tsv"


use rule base as base_variant with:
    input:
        unpack(base_data),
        code=code("base"),
        start=rules.base.input.start,
    output:
        model=directory(VARIANT_OUT["base"]["model"]),
    params:
        cfg=v_cfg("base"),
        data=base_data_arg,
        variant=v_label,
    log:
        f"{LOGS}/{VARIANT}/base.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/base.tsv"


use rule sft as sft_variant with:
    input:
        code=code("sft"),
        train=v_input("prepare", "train"),
        test=v_input("prepare", "test"),
        base=v_input("base", "model"),
    output:
        model=directory(VARIANT_OUT["sft"]["model"]),
    params:
        cfg=v_cfg("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("sft"),
        variant=v_label,
    log:
        f"{LOGS}/{VARIANT}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/sft.tsv"


use rule reward as reward_variant with:
    input:
        code=code("reward"),
        train=v_input("prepare", "train"),
        policy=v_input("sft", "model"),
        start=rules.reward.input.start,
    output:
        model=directory(VARIANT_OUT["reward"]["model"]),
    params:
        cfg=v_cfg("reward"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("reward"),
        variant=v_label,
    log:
        f"{LOGS}/{VARIANT}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/reward.tsv"


use rule rloo as rloo_variant with:
    input:
        unpack(reward_model),
        code=code("train"),
        reward_code=reward_code,
        train=v_input("prepare", "train"),
        val=v_input("prepare", "val"),
        policy=v_input("sft", "model"),
    output:
        model=directory(VARIANT_OUT["rloo"]["model"]),
    params:
        cfg=v_cfg("rloo"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("rloo"),
        reward_model=reward_model_arg,
        variant=v_label,
    log:
        f"{LOGS}/{VARIANT}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_variant with:
    input:
        code=code("evaluate"),
        reward_code=reward_code,
        reward_model=v_input("reward", "model"),
        test=v_input("prepare", "test"),
        manifest=v_input("prepare", "manifest"),
        base=v_input("base", "model"),
        sft=v_input("sft", "model"),
        policy=v_input("rloo", "model"),
        judge=JUDGE_MODEL,
    output:
        **VARIANT_OUT["evaluate"],
    params:
        cfg=v_cfg("evaluate"),
        data=data_dir,
        plots=lambda wildcards, output: os.path.dirname(output.policies),
        policy=v_policy,
        variant=v_label,
    log:
        stage=f"{LOGS}/{VARIANT}/evaluate_{ESTIMATOR}.log",
        judge=f"{LOGS}/{VARIANT}/evaluate_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/{VARIANT}/evaluate_{ESTIMATOR}.tsv"
