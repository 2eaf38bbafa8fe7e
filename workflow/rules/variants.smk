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
        f"{LOGS}/seeds/seed{{seed}}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/seeds/seed{{seed}}/prepare.tsv"


use rule sft as sft_seed with:
    input:
        code=code("sft"),
        train=v_input("prepare", "train"),
        test=v_input("prepare", "test"),
        start=rules.sft.input.start,
    output:
        model=directory(SEED_OUT["sft"]["model"]),
    params:
        cfg=v_cfg("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("sft"),
        variant=v_label,
    log:
        f"{LOGS}/seeds/seed{{seed}}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/seeds/seed{{seed}}/sft.tsv"


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
        f"{LOGS}/seeds/seed{{seed}}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/seeds/seed{{seed}}/reward.tsv"


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
        reward_model=v_reward_model_arg,
        variant=v_label,
    log:
        f"{LOGS}/seeds/seed{{seed}}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/seeds/seed{{seed}}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_seed with:
    input:
        code=code("evaluate"),
        reward_model=v_input("reward", "model"),
        test=v_input("prepare", "test"),
        manifest=v_input("prepare", "manifest"),
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
        stage=f"{LOGS}/seeds/seed{{seed}}/evaluate_{ESTIMATOR}.log",
        judge=f"{LOGS}/seeds/seed{{seed}}/evaluate_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/seeds/seed{{seed}}/evaluate_{ESTIMATOR}.tsv"

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
        f"{LOGS}/sweeps/{{sweep}}/{{point}}/prepare.log",
    benchmark:
        f"{LOGS}/benchmarks/sweeps/{{sweep}}/{{point}}/prepare.tsv"


use rule sft as sft_sweep with:
    input:
        code=code("sft"),
        train=v_input("prepare", "train"),
        test=v_input("prepare", "test"),
        start=rules.sft.input.start,
    output:
        model=directory(SWEEP_OUT["sft"]["model"]),
    params:
        cfg=v_cfg("sft"),
        data=data_dir,
        guard=WORKDIR_GUARD,
        work=v_work("sft"),
        variant=v_label,
    log:
        f"{LOGS}/sweeps/{{sweep}}/{{point}}/sft.log",
    benchmark:
        f"{LOGS}/benchmarks/sweeps/{{sweep}}/{{point}}/sft.tsv"


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
        f"{LOGS}/sweeps/{{sweep}}/{{point}}/reward.log",
    benchmark:
        f"{LOGS}/benchmarks/sweeps/{{sweep}}/{{point}}/reward.tsv"


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
        reward_model=v_reward_model_arg,
        variant=v_label,
    log:
        f"{LOGS}/sweeps/{{sweep}}/{{point}}/rloo_{ESTIMATOR}.log",
    benchmark:
        f"{LOGS}/benchmarks/sweeps/{{sweep}}/{{point}}/rloo_{ESTIMATOR}.tsv"


use rule evaluate as evaluate_sweep with:
    input:
        code=code("evaluate"),
        reward_model=v_input("reward", "model"),
        test=v_input("prepare", "test"),
        manifest=v_input("prepare", "manifest"),
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
        stage=f"{LOGS}/sweeps/{{sweep}}/{{point}}/evaluate_{ESTIMATOR}.log",
        judge=f"{LOGS}/sweeps/{{sweep}}/{{point}}/evaluate_{ESTIMATOR}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/sweeps/{{sweep}}/{{point}}/evaluate_{ESTIMATOR}.tsv"
