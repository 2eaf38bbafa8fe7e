# The variant rules' helpers (workflow/rules/variants.smk): a variant job's inputs, config, work folder,
# MLflow label and policy name, and the aggregate rules' inputs. Functions apart from rules (Snakemake's
# lint asks for it).
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
