"""rloo_workflow: the pipeline around the rloo library: the stages as commands, the Snakemake rules' helpers, config
files, DVC, MLflow tracking, code fingerprints, plans and checks (docs/design.md)."""
