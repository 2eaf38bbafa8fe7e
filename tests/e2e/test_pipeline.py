"""The pipeline's shape is declared once (rloo_workflow/pipeline.py). The CLI's default outputs, the Snakemake
rules' outputs, dvc.yaml's outs and MLflow's output tags all derive from it, and agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from workflow_helpers import CONFIGFILES, make_copy, snakemake

from rloo.code_fingerprint import Fingerprint
from rloo.errors import InputError
from rloo.settings import Config
from rloo_workflow import cli, pipeline, tracking
from rloo_workflow import dvc as rdvc
from rloo_workflow.config import load_config, load_schema

ROOT = Path(__file__).resolve().parents[2]
ESTIMATORS = load_schema()["properties"]["rloo"]["properties"]["estimator"]["enum"]


def _declared(cfg: dict) -> dict[str, set[str]]:
    """Every output path of every stage (for every estimator, where a stage runs once per estimator; for
    every policy, where once per policy)."""
    out = {}
    for name, stage in pipeline.STAGES.items():
        if stage.per_policy:
            out[name] = {p for pol in [*pipeline.POLICIES, *ESTIMATORS]
                         for p in pipeline.outputs(name, cfg, policy=pol).values()}
            continue
        estimators = ESTIMATORS if stage.per_estimator else [None]
        out[name] = {p for e in estimators for p in pipeline.outputs(name, cfg, e).values()}
    return out


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_the_cli_and_mlflow_use_the_declared_outputs_and_names(estimator):
    cfg = load_config(ROOT / "config" / "config.yaml", {"rloo": {"estimator": estimator}})
    declared = _declared(cfg)
    extra = {"comparison": ["--result", "a=b"], "seeds": ["--result", "0=b"], "sweep": ["--name", "x", "--result", "p=b"]}
    for verb, stage in pipeline.BY_VERB.items():
        args = cli.build_parser().parse_args([verb, *extra.get(verb, [])])
        outs = list(pipeline.cli_outputs(args, cfg).values())
        ctx = tracking.cli_context(args, cfg)
        assert ctx["outputs"] == outs  # MLflow tags the md5 of exactly what the CLI writes
        if stage.name == "prepare":  # the CLI's --out is the folder of the declared files
            assert {str(Path(p).parent) for p in declared["prepare"]} == set(outs)
        elif stage.name == "evaluate":  # the policy's records and its figures beside them
            assert outs == list(pipeline.outputs("evaluate", cfg, policy=estimator).values())
        elif stage.name == "report":  # the results file, and the folder of its plots
            assert outs[0] == pipeline.outputs("report", cfg)["result"]
            assert {str(Path(p).parent) for p in pipeline.outputs("report", cfg).values()} - {"results"} == {outs[1]}
        elif stage.name == "sweep":  # the sweep named by --name
            assert set(outs) == set(pipeline.outputs("sweep", cfg, sweep="x").values())
        else:
            assert set(outs) == set(pipeline.outputs(stage.name, cfg).values()) <= declared[stage.name]
        suffix = estimator if (stage.per_estimator and estimator != "rloo") or stage.per_policy else None
        assert ctx["stage"] == (f"{stage.name}_{suffix}" if suffix else stage.name)


@pytest.mark.slow
def test_the_snakemake_rules_write_the_declared_outputs(tmp_path):
    copy = make_copy(tmp_path / "wf")
    res = snakemake(copy, "all", "results/comparison.json", "--summary", *CONFIGFILES)
    assert "Exception" not in res.stdout + res.stderr  # no rule's input function failed on the way
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("output_file\t"))
    by_rule: dict[str, set[str]] = {}
    for line in lines[header + 1 :]:
        path, _, rule, *_ = line.split("\t")
        by_rule.setdefault(rule, set()).add(path)
    # the seeds and sweep aggregates are other targets' (tests/e2e/test_variants.py)
    cfg = load_config(ROOT / "config" / "micro.yaml")
    assert cfg["evaluate"]["judge"] != "llm"  # no judge job: the verifier judges in the report job
    declared = {k: v for k, v in _declared(cfg).items() if k not in ("seeds", "sweep", "judge")}
    assert by_rule == declared


def test_dvc_yaml_outs_are_the_declared_ones():
    cfg = load_config(ROOT / "config" / "config.yaml")
    stages = rdvc.expand_stages(rdvc.load_pipeline(ROOT))
    assert stages
    for name, body in stages.items():
        if "-" in name:  # a stage per job: an evaluation of one policy (evaluate-sft)
            stage, _, policy = name.partition("-")
            declared = pipeline.outputs(stage, cfg, policy=policy)
        else:
            stage, _, estimator = name.partition("@")
            declared = pipeline.outputs(stage, cfg, estimator or None)
        assert set(rdvc.stage_outs(body)) == set(declared.values()), name


def test_a_variant_folder_reads_back_as_its_variant():
    # the variant rules' one wildcard is the variant's folder (workflow/rules/variants.smk)
    cfg = load_config(ROOT / "config" / "micro.yaml", {"sweeps": {"beta": {"rloo.beta": [0.0, 0.1]}}})
    points = pipeline.sweep_grid(cfg, "beta")
    variants = [pipeline.seed_variant(cfg, 3), *(pipeline.sweep_variant(cfg, "beta", p) for p in points)]
    for v in variants:
        assert pipeline.parse_variant(cfg, v.folder) == v
        assert re.fullmatch(pipeline.VARIANT_PATTERN, v.folder), v.folder  # the wildcard's constraint
    assert pipeline.variant_fields("seeds/seed3") == ("seed", {"seed": "3"})
    for folder in ("seeds/3", "sweeps/beta", "seeds/seed1/x"):
        with pytest.raises(InputError, match=f"'{folder}' is not a variant folder: a seed's is seeds/seed"):
            pipeline.parse_variant(cfg, folder)
        assert not re.fullmatch(pipeline.VARIANT_PATTERN, folder)
    with pytest.raises(InputError, match="no sweep named 'lr'"):
        pipeline.parse_variant(cfg, "sweeps/lr/p8066cca7")


def test_the_typed_config_and_its_dict_declare_the_same_pipeline():
    """The Snakefile and the CLI hand the pipeline the validated dict, the library the typed config
    (rloo.settings.Config): both read the same declaration, through the same path."""
    cfg = load_config(ROOT / "config" / "micro.yaml", {"sweeps": {"beta": {"rloo.beta": [0.0, 0.1]}},
                                                       "reward": {"source": "model"}})
    sections = Config.from_config(cfg)
    for stage in pipeline.STAGES:
        for estimator in (None, "ppo"):
            assert pipeline.stage_keys(sections, stage, estimator) == pipeline.stage_keys(cfg, stage, estimator)
            assert pipeline.outputs(stage, sections, estimator) == pipeline.outputs(stage, cfg, estimator)
        assert pipeline.work_dir(stage, sections) == pipeline.work_dir(stage, cfg)
    assert pipeline.sweep_grid(sections, "beta") == pipeline.sweep_grid(cfg, "beta")
    for folder in ("seeds/seed2", *(f"sweeps/beta/{p}" for p in pipeline.sweep_grid(cfg, "beta"))):
        assert pipeline.parse_variant(sections, folder) == pipeline.parse_variant(cfg, folder)
    assert pipeline.upstream("rloo", sections) == pipeline.upstream("rloo", cfg) == ("prepare", "sft", "reward")


MICRO = [ROOT / "config" / "config.yaml", ROOT / "config" / "micro.yaml"]  # as the workflow reads it


def _code(stage: str, cfg: dict | None = None) -> Fingerprint:
    return Fingerprint(stage, f"{stage}0", {})


# The jobs of a result: each evaluated policy's evaluation apart (evaluate:<policy>).
JOBS = [("prepare", None), ("base", None), ("sft", None), ("reward", None), ("rloo", None),
        *(("evaluate", p) for p in ("base", "sft", "rloo")), ("report", None)]
EVALUATIONS = {"evaluate:base", "evaluate:sft", "evaluate:rloo"}


def _lineages(cfg: dict, code=_code, variant=None) -> dict[str, str]:
    """Each job's rerun identity (rloo_workflow.pipeline.identity, the rules' `identity` param)."""
    return {f"{s}:{p}" if p else s: pipeline.identity(cfg, s, code, variant=variant, policy=p).rerun for s, p in JOBS}


def test_a_jobs_identity_holds_every_key_and_code_above_it_and_nothing_else():
    """rloo_workflow.pipeline.identity, the rules' `identity` param: a key or a stage's code changes the identity of
    the jobs reading it and of every job below them, never of a job above or beside them (an RLOO key,
    not the base model's or SFT's evaluation)."""
    cfg = load_config(MICRO)
    before = _lineages(cfg)
    assert _lineages(cfg) == before  # a function of the config and the code alone
    everything = set(before)
    changed = {
        "rloo.lr": {"rloo", "evaluate:rloo", "report"},
        "sft.lr": {"sft", "reward", "rloo", *EVALUATIONS, "report"},  # SFT is every evaluation's reference
        "reward.lr": {"reward", *EVALUATIONS, "report"},  # RLOO trains on the verifier; the proxy of all
        "data.synthetic.n_train": everything,
        "evaluate.examples": {*EVALUATIONS, "report"},
        "threads": set(),  # how a job runs, not what it computes
        "progress_every_s": set(),  # how a job reports
    }
    for key, jobs in changed.items():
        section, *rest = key.split(".")
        node = {rest[-1]: 999} if rest else 999
        for name in reversed(rest[:-1]):
            node = {name: node}
        after = _lineages(load_config(MICRO, {section: node}))
        assert {j for j in before if after[j] != before[j]} == jobs, key
    # the reward model is upstream of RLOO only where RLOO trains on it
    on_model = load_config(MICRO, {"reward": {"source": "model"}})
    assert "reward" in pipeline.upstream("rloo", on_model) and "reward" not in pipeline.upstream("rloo", cfg)
    after = _lineages(load_config(MICRO, {"reward": {"source": "model", "lr": 999}}))
    assert after["rloo"] != _lineages(on_model)["rloo"]
    # a stage's code: that stage and below
    sft_code = _lineages(cfg, lambda stage, c: Fingerprint(stage, f"{stage}{'x' if stage == 'sft' else 0}", {}))
    assert {j for j in before if sft_code[j] != before[j]} == {"sft", "reward", "rloo", *EVALUATIONS, "report"}
    # an evaluation is one job, whichever result reads it
    assert pipeline.identity(cfg, "evaluate", _code, "grpo", policy="sft").rerun == before["evaluate:sft"]


def test_a_variants_jobs_read_the_main_chains_outputs_where_it_shares_them():
    """A seed of scope `rloo` runs rloo, the evaluations (the seed draws their noise) and the report itself:
    their jobs read the main chain's SFT and data and have lineages of their own; the shared jobs' lineages
    are the main chain's. A sweep of rloo.lr reads the main chain's evaluations of the base model and SFT."""
    cfg = load_config(MICRO, {"sweeps": {"lr": {"rloo.lr": [1e-4, 2e-4]}}})
    seed = pipeline.seed_variant(cfg, 3)
    inputs = pipeline.job_inputs(cfg, "evaluate", variant=seed, policy="rloo")
    assert inputs["sft"] == "results/models/sft" and inputs["policy"] == "results/models/seeds/seed3/rloo_rloo"
    assert pipeline.job_inputs(cfg, "rloo", "grpo")["policy"] == "results/models/sft"
    main, seeded = _lineages(cfg), _lineages(cfg, variant=seed)
    assert {j for j in main if main[j] != seeded[j]} == {"rloo", *EVALUATIONS, "report"}
    point = pipeline.sweep_variant(cfg, "lr", next(iter(pipeline.sweep_grid(cfg, "lr"))))
    report = pipeline.job_inputs(cfg, "report", variant=point)
    assert (report["sft"], report["base"]) == ("results/eval/sft.jsonl", "results/eval/base.jsonl")
    assert report["policy"] == f"results/{point.folder}/eval/rloo.jsonl"
    swept = _lineages(cfg, variant=point)
    assert {j for j in main if main[j] != swept[j]} == {"rloo", "evaluate:rloo", "report"}
