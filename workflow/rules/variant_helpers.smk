# The variant rules' outputs (workflow/rules/variants.smk) and the aggregate rules' inputs. Functions apart
# from rules (Snakemake's lint asks for it).
from rloo_workflow.pipeline import seed_variant, sweep_grid, sweep_variant

VARIANT = "{variant}"
# The variant rules' outputs (the config's estimator: the seeds target is results/seeds/gsm8k_<rloo.estimator>.json).
VARIANT_OUT = {name: {k: v.replace("{estimator}", ESTIMATOR) for k, v in rule_outputs(name, config, VARIANT).items()}
               for name in STAGES}
# Their logs and benchmark files (rloo_workflow.commands.job_logs), below the variant's folder.
VARIANT_LOG = {name: job_logs(name, config, ESTIMATOR, "{policy}", VARIANT) for name in STAGES}


# The results file of every seed, and of every point of every sweep: the aggregate rules' inputs.
SEEDS = list(SETTINGS.seeds.values)
SEED_RESULTS = {s: outputs("report", config, ESTIMATOR, seed_variant(config, s))["result"] for s in SEEDS}


def sweep_results(sweep):
    """{point id: results file} of sweep `sweep`; an error naming the sweeps there are, for another name."""
    return {p: outputs("report", config, ESTIMATOR, sweep_variant(config, sweep, p))["result"]
            for p in sweep_grid(config, sweep)}
