from pathlib import Path

import pytest

from rloo_workflow.cli import main
from rloo_workflow.config import ConfigError, load_config, parse_set

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["config.yaml", "gpu.yaml", "micro.yaml", "qwen2-tiny.yaml", "reward_model.yaml",
                                  "tools.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "config" / name)
    assert cfg["rloo"]["k"] >= 2


def test_defaults_are_filled_and_not_shared():
    a = load_config(None)
    b = load_config(None)
    assert a["sft"]["steps"] == 500 and a["data"]["synthetic"]["n_test"] == 500
    a["sft"]["steps"] = 1
    assert b["sft"]["steps"] == 500


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rloo": {"kk": 3}}, "unknown key 'rloo.kk'"),
        ({"sfft": {}}, "unknown key 'sfft'"),
        ({"sft": {"lr": "fast"}}, "key 'sft.lr': 'fast' is not of type 'number'"),
        ({"rloo": {"estimator": "dpo"}}, "key 'rloo.estimator'"),
        ({"rloo": {"k": 0}}, "key 'rloo.k': 0 is less than the minimum of 1"),
        ({"prompt": {"chat_template": "yes"}}, "key 'prompt.chat_template': 'yes' is not one of"),
        # rules across keys, caught at validation (before any stage runs)
        ({"rloo": {"k": 1}}, "key 'rloo.k': the rloo estimator needs k >= 2"),
        # the key set leads (rloo.select's 'best' is the default): test_a_rule_across_keys_leads_with_the_key_set
        ({"rloo": {"eval_every": 0}}, "key 'rloo.eval_every': 0 conflicts with rloo.select='best' (the default): "
                                      "'best' picks a checkpoint by validation accuracy"),
        ({"rloo": {"stop_on": ["reward_hack"]}}, "key 'rloo.stop_on.0'"),
        # the comparison judges every estimator against RLOO's policy: RLOO must be among them
        ({"comparison": {"estimators": ["grpo", "ppo"]}}, "key 'comparison.estimators': must include 'rloo'"),
        ({"comparison": {"estimators": ["rloo", "dpo"]}}, "key 'comparison.estimators.1'"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, override)


def test_bad_yaml_file_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("sft: [unclosed\n")
    with pytest.raises(ConfigError, match=str(p)):
        load_config(p)


def test_config_files_overlay_in_order(tmp_path, capsys):
    """`--config base --config overlay` merges like Snakemake's --configfile; --set goes last."""
    import json

    base = load_config(ROOT / "config" / "config.yaml")
    both = load_config([ROOT / "config" / "config.yaml", ROOT / "config" / "reward_model.yaml"])
    assert base["reward"]["source"] == "verifier" and base["rloo"]["min_solution_steps"] == 2
    assert both["reward"]["source"] == "model" and both["rloo"]["min_solution_steps"] == 0
    assert both["model"] == base["model"] and both["rloo"]["k"] == base["rloo"]["k"]  # kept from the base
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match=f"{bad}: the top level must be a mapping"):
        load_config([ROOT / "config" / "config.yaml", bad])
    assert main(["validate-config", "-c", str(ROOT / "config" / "config.yaml"), "-c",
                 str(ROOT / "config" / "reward_model.yaml"), "--set", "rloo.steps=7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rloo"]["steps"] == 7 and printed["rloo"]["lr"] == both["rloo"]["lr"]
    assert printed["model"]["tiny"] == base["model"]["tiny"]


@pytest.mark.parametrize("key", ["extends", "base"])
def test_an_overlay_names_the_file_it_extends_with_either_spelling(tmp_path, key):
    """`extends:` names the config an overlay lays itself over; `base:`, its old spelling, still reads the
    same; an error names the key as the file spells it."""
    (tmp_path / "parent.yaml").write_text("rloo:\n  k: 3\n  steps: 9\n")
    (tmp_path / "child.yaml").write_text(f"{key}: parent.yaml\nrloo:\n  k: 5\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg["rloo"]["k"], cfg["rloo"]["steps"]) == (5, 9) and "extends" not in cfg and "base" not in cfg
    (tmp_path / "bad.yaml").write_text(f"{key}: 3\n")
    with pytest.raises(ConfigError, match=f"bad.yaml: key '{key}' must be a path to the config this file overlays"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text(f"{key}: loop.yaml\n")
    with pytest.raises(ConfigError, match=f"loop.yaml: key '{key}': loop.yaml is already being read"):
        load_config(tmp_path / "loop.yaml")


def test_an_overlay_with_both_spellings_is_refused(tmp_path):
    (tmp_path / "parent.yaml").write_text("rloo:\n  k: 3\n")
    (tmp_path / "both.yaml").write_text("extends: parent.yaml\nbase: parent.yaml\n")
    with pytest.raises(ConfigError, match=r"both\.yaml: keys 'extends' and 'base' both name the config"):
        load_config(tmp_path / "both.yaml")


EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("overlay", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_overlay_validates(overlay, monkeypatch, capsys):
    """config/examples/: the front page's "your model, your data, your reward" overlays. Each names the
    file it extends; its relative paths (a reward file, data files) are read from the repository's root, where the
    pipeline runs. The micro one runs in tests/e2e/test_reward_plugins.py."""
    import json

    monkeypatch.chdir(ROOT)
    assert main(["validate-config", "-c", str(overlay.relative_to(ROOT))]) == 0, capsys.readouterr().err
    cfg = json.loads(capsys.readouterr().out)
    for key in ("train_file", "test_file"):
        assert cfg["data"][key] is None or (ROOT / cfg["data"][key]).is_file(), cfg["data"][key]
    assert len(EXAMPLES) == 6


def test_cli_reports_config_errors(capsys):
    assert main(["validate-config", "--set", "rloo.k=abc"]) == 2
    assert "rloo.k" in capsys.readouterr().err


def test_stage_config_is_what_each_stage_reads():
    """One definition feeds Snakemake's rerun params and MLflow's: check what it selects."""
    from rloo_workflow.pipeline import stage_config

    cfg = load_config(None, {"reward": {"source": "model"}})
    reward = stage_config(cfg, "reward")
    assert set(reward) == {"seed", "model", "prompt", "reward"}
    assert "source" not in reward["reward"] and "batch_size_score" not in reward["reward"]
    assert reward["reward"]["lr"] == cfg["reward"]["lr"]
    rloo = stage_config(cfg, "rloo", {"rloo.estimator": "grpo"})
    assert rloo["reward"] == {"source": "model", "batch_size_score": cfg["reward"]["batch_size_score"]}
    assert rloo["rloo"]["estimator"] == "grpo" and cfg["rloo"]["estimator"] == "rloo"  # a copy
    judged = stage_config(load_config(None, {"reward": {"source": "judge"}}), "rloo")
    assert set(judged["evaluate"]) == {"judge", "llm_judge"} and judged["reward"] == {"source": "judge"}
    assert stage_config(cfg, "toy") == {"seed": cfg["seed"]}


MICRO_CPU = [ROOT / "config" / "config.yaml", ROOT / "config" / "micro.yaml"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # a CPU run whose RLOO step cannot fit any machine: the decode loop's mask and scores grow with k^2
        ({"rloo": {"k": 100000}}, r"key 'rloo\.k': rloo \(rloo\) would need [\d.]+ TB of host memory on this CPU run "
                                  r"\(sampling: decode mask, scores and sampler [\d.]+ TB\), over the [\d.]+ GB usable "
                                  r"of [\d.]+ GB \(.*\): lower rloo\.k"),
        ({"rloo": {"max_new_tokens": 1000000000}}, r"key 'rloo\.max_new_tokens': 1000000000 new tokens leave no room for "
                                                   r"a prompt within model\.max_length=192"),
        ({"evaluate": {"max_new_tokens": 192}}, r"key 'evaluate\.max_new_tokens'"),
        ({"sft": {"eval_max_new_tokens": 500}}, r"key 'sft\.eval_max_new_tokens'"),
        ({"reward": {"max_new_tokens": 500}}, r"key 'reward\.max_new_tokens'"),
        ({"sft": {"batch_size": 100000000}}, r"key 'sft\.batch_size': 100000000 is more than the 256 training problems "
                                             r"\(data\.synthetic\.n_train\); lower sft\.batch_size to at most 256"),
        ({"data": {"max_train": 100}, "rloo": {"prompts_per_step": 101}}, r"key 'rloo\.prompts_per_step': 101 is more "
                                                                          r"than the 100 training problems \(data\.max_train\)"),
        ({"sft": {"max_train_examples": 8}}, r"key 'sft\.max_train_examples': 8 conflicts with sft\.batch_size=16: 16 is "
                                             r"more than the 8 training problems \(sft\.max_train_examples\)"),
        # a machine (or a Slurm CPU node) of the given size: the interpreter alone needs 0.4 GB
        ({"plan": {"host_memory_gb": 0.3}}, r"would need 0\.\d GB of host memory .* of 0\.3 GB \(plan\.host_memory_gb"),
    ],
)
def test_sizes_are_refused_at_validation_naming_the_key(override, message):
    override = {**override, "model": {"device": "cpu"}}  # a CPU run, whatever this machine has
    with pytest.raises(ConfigError, match=message):
        load_config(MICRO_CPU, override)


CONFIG = ROOT / "config" / "config.yaml"


@pytest.mark.parametrize(("files", "sets", "lead", "other"), [
    # the probe's: a context no micro-batch budget can split (a CPU run's host memory), the budget named
    ([CONFIG], ["model.max_length=100000000"], "model.max_length", "reward.micro_batch_tokens=32768"),
    ([CONFIG], ["model.max_length=20000"], "model.max_length", "reward.micro_batch_tokens=32768"),
    # a context too short for the completions config/micro.yaml sets, and for a default one (96)
    (MICRO_CPU, ["model.max_length=16"], "model.max_length", "sft.eval_max_new_tokens=24"),
    ([CONFIG], ["model.max_length=64"], "model.max_length", "sft.eval_max_new_tokens=96 (the default)"),
    # the other way round, the rule's own key leads: it is the one set
    (MICRO_CPU, ["rloo.max_new_tokens=500"], "rloo.max_new_tokens", "model.max_length=192"),
    # a cap below the batch size of the config file; the validation turned off under select's default
    (MICRO_CPU, ["sft.max_train_examples=8"], "sft.max_train_examples", "sft.batch_size=16"),
    ([], ["rloo.eval_every=0"], "rloo.eval_every", "rloo.select='best' (the default)"),
])
def test_a_rule_across_keys_leads_with_the_key_set(files, sets, lead, other):
    """A refusal tied to several keys names first the one the user set (--set after the files, a file's
    after a default), with the key it conflicts with (issue 61, item 9)."""
    with pytest.raises(ConfigError) as info:
        load_config(files, {**parse_set(sets), "model": {**parse_set(sets).get("model", {}), "device": "cpu"}})
    first = str(info.value).splitlines()[1].strip()
    assert first.startswith(f"key '{lead}':") and other in first, first


def test_keys_set_alike_keep_the_rules_own_key_first(tmp_path):
    # model.max_length and rloo.max_new_tokens both from config files: the rule's key leads, as before
    overlay = tmp_path / "short.yaml"
    overlay.write_text("model: {max_length: 16, device: cpu}\n")
    with pytest.raises(ConfigError) as info:
        load_config([*MICRO_CPU, overlay])
    assert str(info.value).splitlines()[1].strip().startswith("key 'sft.eval_max_new_tokens': 24 new tokens")


def test_a_sweep_value_leads_its_refusal():
    with pytest.raises(ConfigError) as info:
        load_config(MICRO_CPU, {"sweeps": {"ctx": {"model.max_length": [16]}}})
    assert "key 'sweeps.ctx.model.max_length': value 16: key 'model.max_length': 16 conflicts with " in str(info.value)


def test_sizes_that_fit_pass_and_a_gpu_run_is_not_held_to_this_machines_memory():
    assert load_config(MICRO_CPU, {"rloo": {"k": 64}, "model": {"device": "cpu"}})["rloo"]["k"] == 64
    # the GPU plan judges a GPU run (plan.gpu_memory_gb), not the host memory of the machine that validates
    assert load_config(MICRO_CPU, {"rloo": {"k": 100000}, "model": {"device": "cuda"}})["rloo"]["k"] == 100000
    # a data set whose size the config does not say (a hub id): the stage refuses a batch over the rows it counts
    load_config(MICRO_CPU, {"data": {"source": "hub"}, "sft": {"batch_size": 100000}})
