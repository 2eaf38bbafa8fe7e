# rloo pipeline: prepare → base → sft → reward → rloo → evaluate (one job per policy) → report (+ the toy
# experiment and the comparison).
# Laptop:  snakemake --cores all                        (the embedded default on CPU)
# Cluster: snakemake --profile slurm results/gsm8k_rloo.json
# Targets: results/gsm8k_{estimator}.json, results/comparison.json, results/toy_variance.json,
#          results/seeds/gsm8k_<rloo.estimator>.json (seeds.values), results/sweeps/<name>.json (sweeps.<name>)
from snakemake.utils import min_version

min_version("9.17")  # the oldest Snakemake pyproject.toml allows (scripts/test_oldest_snakemake.sh)


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/base.smk"
include: "workflow/rules/sft.smk"
include: "workflow/rules/reward.smk"
include: "workflow/rules/rloo.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/toy.smk"
include: "workflow/rules/comparison.smk"
include: "workflow/rules/variant_helpers.smk"
include: "workflow/rules/variants.smk"
include: "workflow/rules/seeds.smk"
include: "workflow/rules/sweeps.smk"
include: "workflow/rules/tracking.smk"


rule all:
    default_target: True
    input:
        expand(OUT["report"]["result"], estimator=ESTIMATOR),
        OUT["toy"]["result"],
