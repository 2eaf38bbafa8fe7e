# Seeds and sweeps: the chain's rules again for one seed (`<rule>_seed`, wildcard `seed`) or one point
# of a sweep (`<rule>_sweep`, wildcards `sweep` and `point`), with the same commands, resources and
# environment (`use rule`), their outputs, logs and work folders below a folder of their own
# (rloo.pipeline: SEED_FOLDER, SWEEP_FOLDER), so that each runs, and resumes, as a job of its own. A job
# reads the main chain's outputs for the stages its variant does not change (common.smk: v_input), so
# only the changed stages and what follows them run per seed or point. The aggregates: the `seeds` and
# `sweep` rules (workflow/rules/seeds.smk, sweeps.smk).

use rule prepare as prepare_seed with:
    input:
        code=code("prepare"),
        files=rules.prepare.input.files,
    output:
        **SEED_OUT["prepare"],
    params:
        cfg=v_cfg("prepare"),
        out=lambda wildcards, output: os.path.dirname(output.manifest),
        variant=v_label,
    log:
        f"{LOGS}/{SEED_FOLDER}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/prepare.tsv"


use rule base as base_seed with:
    input:
        unpack(v_base_data),
        code=code("base"),
        start=rules.base.input.start,
    output:
        model=directory(SEED_OUT["base"]["model"]),
    params:
        cfg=v_cfg("base"),
        data=base_data_arg,
        variant=v_label,
    log:
        f"{LOGS}/{SEED_FOLDER}/base.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/base.tsv"


use rule sft as sft_seed with:
    input:
        code=code("sft"),
        train=v_input("prepare", "train"),
        test=v_input("prepare", "test"),
        base=v_input("base", "model"),
    output:
        model=directory(SEED_OUT["sft"]["model"]),
    params:
        cfg=v_cfg("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("sft"),
        variant=v_label,
    log:
        f"{LOGS}/{SEED_FOLDER}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/sft.tsv"


use rule reward as reward_seed with:
    input:
        code=code("reward"),
        train=v_input("prepare", "train"),
        policy=v_input("sft", "model"),
        start=rules.reward.input.start,
    output:
        model=directory(SEED_OUT["reward"]["model"]),
    params:
        cfg=v_cfg("reward"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("reward"),
        variant=v_label,
    log:
        f"{LOGS}/{SEED_FOLDER}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/reward.tsv"


use rule rloo as rloo_seed with:
    input:
        unpack(v_reward_model),
        code=code("train"),
        train=v_input("prepare", "train"),
        val=v_input("prepare", "val"),
        policy=v_input("sft", "model"),
    output:
        model=directory(SEED_OUT["rloo"]["model"]),
    params:
        cfg=v_cfg("rloo"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("rloo"),
        reward_model=reward_model_arg,
        variant=v_label,
    log:
        f"{LOGS}/{SEED_FOLDER}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_seed with:
    input:
        code=code("evaluate"),
        reward_model=v_input("reward", "model"),
        test=v_input("prepare", "test"),
        manifest=v_input("prepare", "manifest"),
        base=v_input("base", "model"),
        sft=v_input("sft", "model"),
        policy=v_input("rloo", "model"),
        judge=JUDGE_MODEL,
    output:
        **SEED_OUT["evaluate"],
    params:
        cfg=v_cfg("evaluate"),
        data=data_dir,
        plots=lambda wildcards, output: os.path.dirname(output.policies),
        policy=v_policy,
        variant=v_label,
    log:
        stage=f"{LOGS}/{SEED_FOLDER}/evaluate_{ESTIMATOR}.log",
        judge=f"{LOGS}/{SEED_FOLDER}/evaluate_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/{SEED_FOLDER}/evaluate_{ESTIMATOR}.tsv"

use rule prepare as prepare_sweep with:
    input:
        code=code("prepare"),
        files=rules.prepare.input.files,
    output:
        **SWEEP_OUT["prepare"],
    params:
        cfg=v_cfg("prepare"),
        out=lambda wildcards, output: os.path.dirname(output.manifest),
        variant=v_label,
    log:
        f"{LOGS}/{SWEEP_FOLDER}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/prepare.tsv"


use rule base as base_sweep with:
    input:
        unpack(v_base_data),
        code=code("base"),
        start=rules.base.input.start,
    output:
        model=directory(SWEEP_OUT["base"]["model"]),
    params:
        cfg=v_cfg("base"),
        data=base_data_arg,
        variant=v_label,
    log:
        f"{LOGS}/{SWEEP_FOLDER}/base.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/base.tsv"


use rule sft as sft_sweep with:
    input:
        code=code("sft"),
        train=v_input("prepare", "train"),
        test=v_input("prepare", "test"),
        base=v_input("base", "model"),
    output:
        model=directory(SWEEP_OUT["sft"]["model"]),
    params:
        cfg=v_cfg("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("sft"),
        variant=v_label,
    log:
        f"{LOGS}/{SWEEP_FOLDER}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/sft.tsv"


use rule reward as reward_sweep with:
    input:
        code=code("reward"),
        train=v_input("prepare", "train"),
        policy=v_input("sft", "model"),
        start=rules.reward.input.start,
    output:
        model=directory(SWEEP_OUT["reward"]["model"]),
    params:
        cfg=v_cfg("reward"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("reward"),
        variant=v_label,
    log:
        f"{LOGS}/{SWEEP_FOLDER}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/reward.tsv"


use rule rloo as rloo_sweep with:
    input:
        unpack(v_reward_model),
        code=code("train"),
        train=v_input("prepare", "train"),
        val=v_input("prepare", "val"),
        policy=v_input("sft", "model"),
    output:
        model=directory(SWEEP_OUT["rloo"]["model"]),
    params:
        cfg=v_cfg("rloo"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("rloo"),
        reward_model=reward_model_arg,
        variant=v_label,
    log:
        f"{LOGS}/{SWEEP_FOLDER}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_sweep with:
    input:
        code=code("evaluate"),
        reward_model=v_input("reward", "model"),
        test=v_input("prepare", "test"),
        manifest=v_input("prepare", "manifest"),
        base=v_input("base", "model"),
        sft=v_input("sft", "model"),
        policy=v_input("rloo", "model"),
        judge=JUDGE_MODEL,
    output:
        **SWEEP_OUT["evaluate"],
    params:
        cfg=v_cfg("evaluate"),
        data=data_dir,
        plots=lambda wildcards, output: os.path.dirname(output.policies),
        policy=v_policy,
        variant=v_label,
    log:
        stage=f"{LOGS}/{SWEEP_FOLDER}/evaluate_{ESTIMATOR}.log",
        judge=f"{LOGS}/{SWEEP_FOLDER}/evaluate_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/{SWEEP_FOLDER}/evaluate_{ESTIMATOR}.tsv"
