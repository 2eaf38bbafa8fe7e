"""The seeds and sweeps targets: variants of the chain (rloo_workflow.pipeline.Variant) and their aggregates.

Fast checks first (the config, which stages a variant runs, the aggregates' arithmetic on results
files with distinct figures, MLflow run names, dvc.yaml for both targets); then Snakemake in an
isolated copy (tests/helpers/workflow_helpers.py): dry-run plans, and one real micro run of each target, the
seeds target (2 seeds) first and the sweep (2 points) on its prepare/sft/reward.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import copy_tree
from workflow_helpers import CONFIGFILES, ROOT, env_for, job_counts, make_copy, planned, snakemake

from rloo.errors import InputError
from rloo.eval.stats import t_interval
from rloo_workflow import cli, pipeline, tracking
from rloo_workflow.config import ConfigError, load_config
from rloo_workflow.dvc import dvcyaml as rdvc
from rloo_workflow.pipeline import point_id, stage_config, sweep_grid, sweep_variant
from rloo_workflow.seed_table import aggregate
from rloo_workflow.sweep_table import table

SEEDS = "results/seeds/gsm8k_rloo.json"
MICRO = [ROOT / "config" / "config.yaml", ROOT / "config" / "micro.yaml"]


# --- the config -------------------------------------------------------------------------------------


def test_seeds_and_sweeps_defaults_and_no_stage_reads_them():
    cfg = load_config(MICRO)
    assert cfg["seeds"] == {"values": [0, 1, 2], "scope": "rloo"} and cfg["sweeps"] == {}
    other = load_config(MICRO, {"seeds": {"values": [7], "scope": "all"}, "sweeps": {"b": {"rloo.beta": [0.2]}}})
    for stage in pipeline.STAGES:  # so changing them reruns nothing of the main chain
        assert stage_config(cfg, stage) == stage_config(other, stage), stage


@pytest.mark.parametrize(("sweep", "message"), [
    ({"rloo.bta": [0.1]}, "key 'sweeps.s.rloo.bta': unknown config key 'rloo.bta'"),
    ({"rloo.k": ["two"]}, "key 'sweeps.s.rloo.k': value 'two'"),
    ({"rloo.k": [1]}, "key 'sweeps.s.rloo.k': value 1"),  # the estimator's cross-check: k >= 2
    ({"paths.models": ["x"]}, "key 'sweeps.s.paths.models': 'paths.models' is not a config key a sweep can set"),
])
def test_a_bad_sweep_key_or_value_is_an_error_naming_it(sweep, message):
    with pytest.raises(ConfigError) as e:
        load_config(MICRO, {"sweeps": {"s": sweep}})
    assert message in str(e.value)


def test_sweep_values_are_coerced_as_the_configs_own():
    cfg = load_config(MICRO, {"sweeps": {"s": {"rloo.beta": ["0.1", "1e-2"]}}, "seeds": {"values": ["3"]}})
    assert cfg["sweeps"]["s"]["rloo.beta"] == [0.1, 0.01] and cfg["seeds"]["values"] == [3]


# --- which stages a variant runs ----------------------------------------------------------------------


EVALUATIONS = {"evaluate:base", "evaluate:sft", "evaluate:rloo"}


def owned(variant, cfg) -> set[str]:
    """The jobs of the main chain's results that `variant` runs itself (an evaluation as evaluate:<policy>)."""
    jobs = [(s, None) for s in pipeline.CHAIN if s not in ("evaluate", "judge")]
    jobs += [("evaluate", p) for p in ("base", "sft", "rloo")]
    return {f"{s}:{p}" if p else s for s, p in jobs if pipeline.owns(variant, cfg, s, policy=p)}


def test_seed_scope_decides_the_stages_run_per_seed():
    cfg = load_config(MICRO)
    # scope rloo: RLOO, and every evaluation, whose decoding noise the seed draws (so SFT's too), and the report
    assert owned(pipeline.seed_variant(cfg, 1), cfg) == {"rloo", *EVALUATIONS, "report"}
    cfg["seeds"]["scope"] = "all"
    v = pipeline.seed_variant(cfg, 1)
    assert owned(v, cfg) == {"prepare", "base", "sft", "reward", "rloo", *EVALUATIONS, "report"}
    assert v.overrides == {"seed": 1} and v.label == "seed=1"
    assert pipeline.outputs("sft", cfg, variant=v)["model"] == "results/models/seeds/seed1/sft"
    assert pipeline.work_dir("rloo", cfg, variant=v) == "results/work/seeds/seed1/rloo_rloo"


@pytest.mark.parametrize(("axes", "varied"), [
    # RLOO's keys: its policy's evaluation and the report; the base model's and SFT's evaluations are shared
    ({"rloo.beta": [0.0, 0.1], "rloo.k": [2, 4]}, {"rloo", "evaluate:rloo", "report"}),
    ({"sft.lr": [1e-3]}, {"sft", "reward", "rloo", *EVALUATIONS, "report"}),
    ({"reward.lr": [1e-3]}, {"reward", *EVALUATIONS, "report"}),  # RLOO trains on the verifier here
    ({"evaluate.examples": [8]}, {*EVALUATIONS, "report"}),
])
def test_a_sweep_point_reruns_only_the_stages_reading_its_keys(axes, varied):
    cfg = load_config(MICRO, {"sweeps": {"s": axes}})
    points = sweep_grid(cfg, "s")
    assert len(points) == len(list(itertools.product(*axes.values())))
    pid = next(iter(points))
    v = sweep_variant(cfg, "s", pid)
    assert owned(v, cfg) == varied and v.folder == f"sweeps/s/{pid}"
    assert pipeline.outputs("prepare", cfg, variant=v) == pipeline.outputs("prepare", cfg)  # shared
    assert point_id(points[pid]) == pid  # stable: a function of the point's values
    # a well-formed id that is not a point of this grid gets no point's values: one error listing them
    with pytest.raises(InputError, match=rf"sweep s: no point 'p0000000' in its grid .* points: {pid}"):
        sweep_variant(cfg, "s", "p0000000")


def test_variant_jobs_get_mlflow_runs_named_after_their_seed():
    cfg = load_config(MICRO)
    parse = cli.build_parser().parse_args
    assert tracking.cli_context(parse(["train", "--variant", "seed=1"]), cfg)["stage"] == "rloo[seed=1]"
    assert tracking.cli_context(parse(["evaluate", "--policy", "rloo=x", "--variant", "seed=1"]), cfg)["stage"] == \
        "evaluate_rloo[seed=1]"
    assert tracking.cli_context(parse(["evaluate", "--policy", "sft=x"]), cfg)["stage"] == "evaluate_sft"
    assert tracking.cli_context(parse(["report", "--variant", "seed=1"]), cfg)["stage"] == "report[seed=1]"
    assert tracking.cli_context(parse(["train"]), cfg)["stage"] == "rloo"
    assert pipeline.base_stage("evaluate_grpo[seed=2]") == "evaluate"


# --- the aggregates' arithmetic -------------------------------------------------------------------------


def fake_result(i: int) -> dict:
    """A results file of distinct figures (the micro policy solves nothing: every figure would be 0)."""
    g = lambda x: {"gain": x, "ci95": [x - 0.05, x + 0.05], "p_value": 0.01 * (i + 1)}  # noqa: E731
    return {"policies": {"sft": {"accuracy": 0.5 + 0.01 * i, "accuracy_sampled": 0.4 + 0.02 * i},
                         "rloo": {"accuracy": 0.55 + 0.03 * i, "accuracy_sampled": 0.47 + 0.01 * i}},
            "gains": {"rloo": {"sampled": g(0.07 - 0.01 * i), "greedy": g(0.05 + 0.02 * i)}},
            "training": {"rloo": {"selected_val_accuracy_sampled": [0.3, 0.6, 0.5][i]}}}


def test_seeds_aggregate_is_computed_from_each_seeds_file():
    results = {s: fake_result(i) for i, s in enumerate((0, 4, 9))}
    out = aggregate(results, "rloo")
    assert list(out["seeds"]) == ["0", "4", "9"]
    assert out["seeds"]["4"]["gain_sampled_p_value"] == 0.02
    gains = [r["gains"]["rloo"]["sampled"]["gain"] for r in results.values()]
    assert out["aggregate"]["gain_sampled"]["mean"] == pytest.approx(sum(gains) / 3)
    assert out["aggregate"]["gain_sampled"]["ci95"] == pytest.approx(list(t_interval(gains)))
    assert out["aggregate"]["rloo_greedy"]["mean"] == pytest.approx((0.55 + 0.58 + 0.61) / 3)


def test_sweep_best_is_chosen_by_validation_not_test():
    points = {"pa": {"rloo.beta": 0.0}, "pb": {"rloo.beta": 0.1}, "pc": {"rloo.beta": 0.2}}
    results = {p: fake_result(i) for i, p in enumerate(points)}
    tab = table("s", points, results, "rloo")
    # validation: pb (0.6) is best; test (sampled): pc (0.49) would be
    assert tab["best"]["point"] == "pb" and tab["best"]["val_accuracy_sampled"] == 0.6
    assert tab["best"]["runner_up"]["point"] == "pc" and tab["best"]["margin"] == 0.6 - 0.5 and tab["tie"] is None
    assert tab["sweep"] == "s" and tab["keys"] == ["rloo.beta"]
    assert [r["test"]["rloo_sampled"] for r in tab["rows"]] == [0.47, 0.48, 0.49]


# --- dvc.yaml -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("folder", "rule", "wildcards", "stage"), [
    ("seeds/seed1", "rloo_seed", {"seed": "1"}, "rloo_seed@1"),
    ("sweeps/beta/p8066cca7", "rloo_sweep", {"sweep": "beta", "point": "p8066cca7"}, "rloo_sweep-beta-p8066cca7"),
])
def test_a_variant_rules_dvc_stage_is_named_by_the_variants_kind(folder, rule, wildcards, stage):
    # one rule per stage in the workflow (`rloo_variant`, wildcard: the folder, which a DVC stage name
    # cannot hold); its DVC stages by kind: a seed's an item of a foreach stage, a sweep point's its own
    assert rdvc.dvc_rule("rloo_variant", {"variant": folder}) == (rule, wildcards)
    assert rdvc.stage_name("rloo_variant", {"variant": folder}) == stage
    assert rdvc.variant_job(rule, "-".join(wildcards.values())) == ("rloo_variant", {"variant": folder})
    assert rdvc.dvc_rule("rloo", {"estimator": "grpo"}) == ("rloo", {"estimator": "grpo"})
    assert rdvc.variant_job("sweep", "beta") is None and rdvc.variant_job("rloo", "grpo") is None
    # a variant rule with another wildcard (an evaluation's policy): a stage per job, its value after the folder's
    evaluation = {"variant": folder, "policy": "sft"}
    assert rdvc.dvc_rule("evaluate_variant", evaluation) == (rule.replace("rloo", "evaluate"), {**wildcards, "policy": "sft"})
    named = rdvc.stage_name("evaluate_variant", evaluation)
    assert named == f"{rule.replace('rloo', 'evaluate')}-{'-'.join(wildcards.values())}-sft"
    assert rdvc.variant_job(rule.replace("rloo", "evaluate"), named.split("-", 1)[1], ("policy",)) == (
        "evaluate_variant", evaluation)


@pytest.mark.slow
def test_dvc_yaml_for_the_seeds_and_sweep_targets(tmp_path):
    # `rloo dvc yaml` in a copy (its package, as the rules' code inputs), for both targets
    copy_ = make_copy(tmp_path / "wf")
    (copy_ / "config" / "sweep.yaml").write_text("sweeps: {beta: {rloo.beta: [0.0, 0.1]}}\n")
    res = subprocess.run([sys.executable, "-m", "rloo_workflow.dvc", "yaml", "--configfile", *CONFIGFILES[1:], "config/sweep.yaml",
                          "--target", SEEDS, "--target", "results/sweeps/beta.json"],
                         cwd=copy_, env=env_for(copy_), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    pipe = yaml.safe_load((copy_ / "dvc.yaml").read_text())
    st = pipe["stages"]
    # every seed's stages: foreach stages over the seeds (scope rloo: rloo, the evaluations and the report per
    # seed), an evaluation's a stage of its own per seed and policy (its inputs depend on the policy)
    assert st["rloo_seed"]["foreach"] == ["0", "1", "2"] and st["report_seed"]["foreach"] == ["0", "1", "2"]
    assert {f"evaluate_seed-{s}-{p}" for s in range(3) for p in ("base", "sft", "rloo")} <= set(st), sorted(st)
    assert "--policy sft=results/models/sft" in st["evaluate_seed-1-sft"]["cmd"]
    assert "--set seed=1" in st["evaluate_seed-1-sft"]["cmd"]
    assert "--set seed=${item}" in st["rloo_seed"]["do"]["cmd"] and "--variant seed=${item}" in st["rloo_seed"]["do"]["cmd"]
    assert "seeds" in st and "sft_seed" not in st
    # a sweep's jobs: a stage each (DVC reads @ as foreach's)
    points = sorted(k for k in st if k.startswith("rloo_sweep-beta-"))
    assert len(points) == 2 and "sweep-beta" in st
    assert {"--set rloo.beta=0.0" in st[p]["cmd"] or "--set rloo.beta=0.1" in st[p]["cmd"] for p in points} == {True}


# --- Snakemake: plans -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wf(tmp_path_factory) -> Path:
    return make_copy(tmp_path_factory.mktemp("variants"))


@pytest.mark.slow
def test_seeds_plan_shares_the_chain_up_to_rloo(wf):
    # scope rloo: each seed's RLOO, its three evaluations (the seed draws their noise) and its report
    assert planned(wf, SEEDS) == {"prepare": 1, "base": 1, "sft": 1, "reward": 1, "rloo_variant": 3,
                                  "evaluate_variant": 9, "report_variant": 3, "seeds": 1}
    assert planned(wf, SEEDS, extra_config="seeds: {values: [0, 1], scope: all}") == {
        "prepare_variant": 2, "base_variant": 2, "sft_variant": 2, "reward_variant": 2, "rloo_variant": 2,
        "evaluate_variant": 6, "report_variant": 2, "seeds": 1}


@pytest.mark.slow
def test_sweep_plans_run_only_the_changed_stages_per_point(wf):
    # a grid over rloo.*: the main chain's evaluations of the base model and of SFT, once for every point
    assert planned(wf, "results/sweeps/beta.json", extra_config="sweeps: {beta: {rloo.beta: [0.0, 0.1]}}") == {
        "prepare": 1, "base": 1, "sft": 1, "reward": 1, "evaluate": 2, "rloo_variant": 2, "evaluate_variant": 2,
        "report_variant": 2, "sweep": 1}
    assert planned(wf, "results/sweeps/lr.json", extra_config="sweeps: {lr: {sft.lr: [1.0e-3, 2.0e-3]}}") == {
        "prepare": 1, "base": 1, "sft_variant": 2, "reward_variant": 2, "rloo_variant": 2, "evaluate_variant": 6,
        "report_variant": 2, "sweep": 1}


@pytest.mark.slow
def test_a_sweep_over_an_unknown_key_fails_before_anything_runs(wf):
    (wf / "config" / "bad.yaml").write_text("sweeps: {beta: {rloo.bta: [0.0, 0.1]}}\n")
    res = snakemake(wf, "results/sweeps/beta.json", "-n", *CONFIGFILES, "config/bad.yaml", check=False)
    assert res.returncode != 0 and "sweeps.beta.rloo.bta" in res.stdout + res.stderr


# --- Snakemake: real micro runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ran(micro_workflow, tmp_path_factory) -> Path:
    """A copy of the session's micro run (tests/conftest.py): the main chain's prepare, sft and reward
    are done, as on a user's machine that ran the default target before asking for seeds or a sweep."""
    return copy_tree(micro_workflow["copy"], tmp_path_factory.mktemp("variants-ran") / "wf")


def _rewrite(path: Path, i: int) -> dict:
    """Give a per-seed (per-point) results file distinct figures, keeping everything else."""
    result = json.loads(path.read_text())
    fake = fake_result(i)
    for name in ("sft", "rloo"):
        result["policies"][name].update(fake["policies"][name])
    result["gains"]["rloo"]["sampled"].update(fake["gains"]["rloo"]["sampled"])
    result["gains"]["rloo"]["greedy"].update(fake["gains"]["rloo"]["greedy"])
    result["training"]["rloo"].update(fake["training"]["rloo"])
    path.write_text(json.dumps(result))
    return result


@pytest.mark.slow
def test_seeds_target_runs_each_seed_and_aggregates_its_files(ran):
    wf = ran
    t0 = time.monotonic()
    # tracked (the other workflow tests run untracked): one MLflow child run per seed and stage
    res = snakemake(wf, SEEDS, "--cores", "1", *CONFIGFILES, "--config", "seeds={values: [0, 1]}",
                    "tracking={enabled: true}", timeout=900)
    # scope rloo: the main chain's prepare, sft and reward (already run) are reused, not run again
    assert job_counts(res.stdout + res.stderr) == {"rloo_variant": 2, "evaluate_variant": 6, "report_variant": 2,
                                                   "seeds": 1}
    print(f"seeds target, 2 seeds, tracked: {time.monotonic() - t0:.1f} s")
    pipeline_run = json.loads((wf / "results/runs/pipeline.json").read_text())["run_id"]
    runs = {p.stem: json.loads(p.read_text()) for p in (wf / "results/runs").glob("*.json") if p.stem != "config"}
    assert set(runs) == {"pipeline", "seeds", *(f"{job}[seed={s}]" for s in (0, 1) for job in (
        "rloo", "evaluate_base", "evaluate_sft", "evaluate_rloo", "report"))}
    assert {r["parent_run_id"] for name, r in runs.items() if name != "pipeline"} == {pipeline_run}
    for s in (0, 1):
        assert (wf / f"results/models/seeds/seed{s}/rloo_rloo/metrics.json").is_file()
        assert (wf / f"results/work/seeds/seed{s}/rloo_rloo/identity.json").is_file()
        assert (wf / f"logs/seeds/seed{s}/rloo_rloo.log").is_file()
    assert not (wf / "results/models/seeds/seed0/sft").exists()  # scope rloo: the main chain's SFT
    assert (wf / "results/seeds/gsm8k_rloo.png").stat().st_size > 1000
    # The micro policy solves nothing (every figure 0): give each seed's file distinct figures and
    # aggregate again, so that a figure taken from the wrong file, or not from a file, shows.
    files = {s: wf / f"results/seeds/seed{s}/gsm8k_rloo.json" for s in (0, 1)}
    results = {s: _rewrite(f, i) for i, (s, f) in enumerate(files.items())}
    snakemake(wf, SEEDS, "--cores", "1", *CONFIGFILES, "--config", "seeds={values: [0, 1]}")
    out = json.loads((wf / SEEDS).read_text())
    assert out == {**aggregate(copy.deepcopy(results), "rloo"), "sources": {str(s): f"results/seeds/seed{s}/gsm8k_rloo.json"
                                                                       for s in files},
                   "plot": "results/seeds/gsm8k_rloo.png"}
    for s, r in results.items():
        row = out["seeds"][str(s)]
        assert row["rloo_sampled"] == r["policies"]["rloo"]["accuracy_sampled"]
        assert row["gain_greedy_ci95"] == r["gains"]["rloo"]["greedy"]["ci95"]
    gains = [r["gains"]["rloo"]["sampled"]["gain"] for r in results.values()]
    assert out["aggregate"]["gain_sampled"]["ci95"] == pytest.approx(list(t_interval(gains)))
    summary = _summary(wf / SEEDS)
    assert summary.returncode == 0 and "seeds: mean over 2 seeds: RLOO − SFT " in summary.stdout, summary.stderr


def _summary(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("rloo")), "summary", str(path)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_sweep_target_runs_each_point_and_picks_the_best_by_validation(ran):
    wf = ran
    sweep = "results/sweeps/beta.json"
    (wf / "config" / "sweep.yaml").write_text("sweeps: {beta: {rloo.beta: [0.0, 0.1]}}\n")
    files = [*CONFIGFILES, "config/sweep.yaml"]
    assert (wf / "results/models/sft").is_dir()  # the main chain's, run before
    cfg = load_config([*MICRO, wf / "config" / "sweep.yaml"])
    points = sweep_grid(cfg, "beta")
    point_files = [f"results/sweeps/beta/{pid}/gsm8k_rloo.json" for pid in points]
    t0 = time.monotonic()
    # the points first, then the table: the sweep's log shows each point as its report ends
    res = snakemake(wf, *point_files, "--cores", "1", *files, timeout=900)
    log = wf / "logs" / "sweep_beta.log"
    assert [re.sub(r"^\S+ ", "", line)[:19] for line in log.read_text().splitlines()] == [
        "point 1 of 2 done: ", "point 2 of 2 done: "]
    res2 = snakemake(wf, sweep, "--cores", "1", *files, timeout=900)
    print(f"sweep target, 2 points: {time.monotonic() - t0:.1f} s")
    # a grid over rloo.* reuses prepare, sft and reward, and the evaluations of the base model and of SFT
    # (and a seeds run before it changes nothing of them)
    assert job_counts(res.stdout + res.stderr) == {"rloo_variant": 2, "evaluate_variant": 2, "report_variant": 2}
    assert job_counts(res2.stdout + res2.stderr) == {"sweep": 1}
    for pid in points:
        assert (wf / f"results/sweeps/beta/{pid}/gsm8k_rloo.json").is_file()
        assert (wf / f"results/models/sweeps/beta/{pid}/rloo_rloo/metrics.json").is_file()
    # The micro policy solves nothing: every point's validation accuracy is 0, a tie that no point won
    # (grid order once named the first point best); the terminal, the log and `rloo summary` say so.
    tied = json.loads((wf / sweep).read_text())
    assert {r["val_accuracy_sampled"] for r in tied["rows"]} == {0.0}
    assert tied["best"] is None and tied["tie"] == {"points": list(points), "val_accuracy_sampled": 0.0,
                                                    "labels": [f"rloo.beta={v['rloo.beta']}" for v in points.values()]}
    assert "sweep beta: tie: rloo.beta=0.0, rloo.beta=0.1" in res2.stdout + res2.stderr
    assert "sweep beta: tie: " in log.read_text() and log.read_text().count("validation 0.000;") == 2
    summary = _summary(wf / sweep)
    assert summary.returncode == 0 and "sweep beta: tie: " in summary.stderr
    # distinct figures where validation and test disagree: the first point best by test, the second by validation
    results = {}
    for i, pid in enumerate(points):
        results[pid] = _rewrite(wf / f"results/sweeps/beta/{pid}/gsm8k_rloo.json", i)
        results[pid]["policies"]["rloo"]["accuracy_sampled"] = 0.9 - 0.1 * i
        (wf / f"results/sweeps/beta/{pid}/gsm8k_rloo.json").write_text(json.dumps(results[pid]))
    snakemake(wf, sweep, "--cores", "1", *files)
    out = json.loads((wf / sweep).read_text())
    assert out["sweep"] == "beta" and out["keys"] == ["rloo.beta"]
    val = {p: r["training"]["rloo"]["selected_val_accuracy_sampled"] for p, r in results.items()}
    assert out["best"]["point"] == max(val, key=val.get) == list(points)[1]
    # its margin over the runner-up, on the validation figure that chose it
    first, second = points
    assert out["best"]["runner_up"]["point"] == first and out["tie"] is None
    assert out["best"]["margin"] == val[second] - val[first]
    summary = _summary(wf / sweep)
    assert summary.returncode == 0 and f"best by validation accuracy (sampled): {out['best']['label']}" in summary.stdout
    for pid in points:  # and each point's results
        assert _summary(wf / f"results/sweeps/beta/{pid}/gsm8k_rloo.json").returncode == 0
    assert [r["test"]["rloo_sampled"] for r in out["rows"]] == [0.9, 0.8]
    assert out["points"] == {p: {"label": f"rloo.beta={v['rloo.beta']}", "values": v} for p, v in points.items()}
    assert (wf / "results/sweeps/beta.png").stat().st_size > 1000
