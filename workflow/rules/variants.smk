# Seeds and sweeps (rloo.pipeline.Variant): the chain's rules again (`<rule>_variant`) for one variant,
# a seed of the `seeds` target or a point of a sweep, named by its folder: the wildcard `variant`,
# seeds/seed<N> or sweeps/<sweep>/<point id> (rloo.pipeline: VARIANT_FOLDERS; parse_variant reads the
# seed or point back from it). The same commands, resources and environment (`use rule`), their
# outputs, logs and work folders below that folder, so that each runs, and resumes, as a job of its
# own. A job reads the main chain's outputs for the stages its variant does not change (v_input), so
# only the changed stages and what follows them run per seed or point. The aggregates: the `seeds`
# and `sweep` rules (workflow/rules/seeds.smk, sweeps.smk), on SEED_RESULTS and sweep_results.
import shlex

from rloo.pipeline import seed_variant, sweep_grid, sweep_variant

VARIANT = "{variant}"
# The variant rules' outputs (the config's estimator: the seeds target is results/seeds/gsm8k_<rloo.estimator>.json).
VARIANT_OUT = {name: {k: v.replace("{estimator}", ESTIMATOR) for k, v in rule_outputs(name, config, VARIANT).items()}
               for name in STAGES}


def v_input(stage, kind):
    """An input function: `stage`'s output `kind` for the job's variant, the main chain's where the
    variant does not change the stage (shared)."""
    return lambda wildcards: outputs(stage, config, ESTIMATOR, job_variant(wildcards))[kind]


def v_cfg(stage):
    """A variant rule's `cfg` param: what `stage` reads of the variant's config (a key the stage does not
    read, e.g. sft.lr for rloo, stays out of it, as in the main chain's rules)."""
    def cfg(wildcards):
        vcfg = job_config(wildcards)
        part = _stage_config(vcfg, stage, {"rloo.estimator": vcfg["rloo"]["estimator"]} if stage == "rloo" else None)
        return json.dumps(part, sort_keys=True, separators=(",", ":"))

    return cfg


def v_work(stage):
    return lambda wildcards: work_dir(stage, config, ESTIMATOR, job_variant(wildcards))


def v_label(wildcards):
    """`--variant LABEL`: the job's MLflow run is named <stage>[LABEL] (rloo[seed=1])."""
    return f"--variant {shlex.quote(job_variant(wildcards).label)}"


def v_policy(wildcards):
    """The trained policy's name in a variant's results: its estimator (a sweep may set rloo.estimator)."""
    return job_config(wildcards)["rloo"]["estimator"]


# The results file of every seed, and of every point of every sweep: the aggregate rules' inputs.
SEEDS = config["seeds"]["values"]
SEED_RESULTS = {s: outputs("evaluate", config, ESTIMATOR, seed_variant(config, s))["result"] for s in SEEDS}


def sweep_results(sweep):
    """{point id: results file} of sweep `sweep`; an error naming the sweeps there are, for another name."""
    return {p: outputs("evaluate", config, ESTIMATOR, sweep_variant(config, sweep, p))["result"]
            for p in sweep_grid(config, sweep)}


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
