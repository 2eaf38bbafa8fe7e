"""RLOO from Python (rloo/api.py): one call on a policy folder, prompt rows and a reward function in TRL's
form trains as `rloo train` does (the same steps and the same weights, to the bit), `evaluate` scores
policies on rows in memory as `rloo evaluate` and `rloo report` do (to the digit), load_rows reads a
user's records as `rloo prepare` does, and the README's snippet runs as it is written."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import reward_functions

from rloo.api import (
    Config,
    RewardConfig,
    RlooConfig,
    evaluate,
    load_rows,
    train_reward_model,
    train_rloo,
    train_sft,
)
from rloo.data.gsm8k import DataError, read_split
from rloo.errors import InputError
from rloo.io import read_jsonl
from rloo.rollout.collect import training_prompts
from rloo_workflow.config import load_config
from rloo_workflow.stages import prepare
from rloo_workflow.stages import rloo as rloo_stage

ROOT = Path(__file__).resolve().parents[2]
MICRO = ROOT / "config" / "micro.yaml"
SHORTER = f"{ROOT / 'tests' / 'helpers' / 'reward_functions.py'}:shorter"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("given", ["folder", "model object"])
def test_the_python_api_trains_as_the_rloo_stage_does(micro_run, tmp_path, given):
    from rloo.model import models

    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["reward"].update(source="function", functions=[{"name": "shorter", "fn": SHORTER, "weight": 1.0,
                                                        "max_failed_share": 0.0}])
    rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "stage", tmp_path / "stage.work")
    rows = training_prompts(read_split(micro_run["data"], "train"), cfg["rloo"]["min_solution_steps"])
    logged = []
    policy, tokenizer = micro_run["sft"], None
    if given == "model object":
        policy, tokenizer = models.load_causal_lm(micro_run["sft"]), models.load_tokenizer(micro_run["sft"])
        before = {k: v.clone() for k, v in policy.state_dict().items()}
    summary = train_rloo(policy, rows, tmp_path / "api", reward=reward_functions.shorter, tokenizer=tokenizer,
                         validation=read_split(micro_run["data"], "val"), config=Config.from_config(cfg),
                         log=lambda m, step: logged.append(step))
    stage, api = tmp_path / "stage", tmp_path / "api"
    assert (api / "steps.jsonl").read_bytes() == (stage / "steps.jsonl").read_bytes()
    assert _digest(api / "model.safetensors") == _digest(stage / "model.safetensors")
    steps = [json.loads(line) for line in (api / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == cfg["rloo"]["steps"] and "train/reward/shorter" in steps[0]
    assert summary["steps_trained"] == cfg["rloo"]["steps"] and summary["reward_source"] == "function"
    assert logged[: cfg["rloo"]["steps"]] == list(range(cfg["rloo"]["steps"]))  # every step's figures
    assert (tmp_path / "api.work" / "checkpoints").is_dir()  # beside the output, as a rerun resumes from them
    if given == "model object":  # trained from its saved copy; the caller's object is left as it was
        assert (tmp_path / "api.work" / "start" / "model.safetensors").is_file()
        assert all(v.equal(before[k]) for k, v in policy.state_dict().items())


@pytest.mark.slow
def test_sft_from_python_trains_as_the_sft_stage_does(micro_run, tmp_path):
    """rloo.api.train_sft on the micro run's base model and splits writes the SFT stage's policy and
    metrics to the bit (micro_run's folder is the stage's output)."""
    cfg, data = micro_run["cfg"], micro_run["data"]
    logged = []
    metrics = train_sft(micro_run["base_model"], read_split(data, "train"), tmp_path / "sft",
                        test=read_split(data, "test"), config=Config.from_config(cfg),
                        log=lambda m, step: logged.append(step))
    assert _digest(tmp_path / "sft" / "model.safetensors") == _digest(micro_run["sft"] / "model.safetensors")
    assert (tmp_path / "sft" / "metrics.json").read_bytes() == (micro_run["sft"] / "metrics.json").read_bytes()
    assert metrics["accuracy"] == micro_run["sft_metrics"]["accuracy"] and 0 in logged
    with pytest.raises(InputError, match="test rows are needed"):
        train_sft(micro_run["base_model"], read_split(data, "train"), tmp_path / "other", test=[])


@pytest.mark.slow
def test_the_reward_model_from_python_trains_as_the_reward_stage_does(micro_run, micro_reward, tmp_path):
    """rloo.api.train_reward_model on the micro run's SFT policy and training split writes the reward
    stage's model, metrics and history to the bit (micro_reward is the stage's output)."""
    cfg, data = micro_run["cfg"], micro_run["data"]
    logged = []
    metrics = train_reward_model(micro_run["sft"], read_split(data, "train"), tmp_path / "rm",
                                 config=Config.from_config(cfg), log=lambda m, step: logged.append(step))
    assert _digest(tmp_path / "rm" / "model.safetensors") == _digest(micro_reward / "model.safetensors")
    for name in ("metrics.json", "history.json"):
        assert (tmp_path / "rm" / name).read_bytes() == (micro_reward / name).read_bytes()
    rc = Config.from_config(cfg).reward
    # the logged steps (every reward.log_every, and the last), then the run's figures at the end
    assert [s for s in logged if s < rc.steps] == sorted({*range(0, rc.steps, rc.log_every), rc.steps - 1})
    assert metrics["val_accuracy"] == json.loads((micro_reward / "metrics.json").read_text())["val_accuracy"]
    assert (tmp_path / "rm.work" / "timings.json").is_file()  # the work folder beside the output
    with pytest.raises(InputError, match="no rows to sample preference pairs from"):
        train_reward_model(micro_run["sft"], [], tmp_path / "other", config=RewardConfig(steps=2))


def test_settings_that_cannot_train_are_refused_before_anything_loads(micro_run, tmp_path):
    from rloo.model import models

    last = RlooConfig(eval_every=0, select="last")
    with pytest.raises(InputError, match="a model object needs its tokenizer"):
        train_rloo(models.load_causal_lm(micro_run["sft"]), [{"question": "q"}], tmp_path, reward=reward_functions.shorter,
                   config=last)
    with pytest.raises(InputError, match="policy: a model folder or a transformers model object, not dict"):
        train_rloo({}, [{"question": "q"}], tmp_path, reward=reward_functions.shorter, config=last)
    with pytest.raises(InputError, match="validation rows are needed"):
        train_rloo(tmp_path / "nosuch", [{"question": "q", "answer": "#### 1"}], tmp_path, reward=reward_functions.shorter)
    with pytest.raises(InputError, match=r"key 'rloo.k': the rloo estimator needs k >= 2"):
        train_rloo(tmp_path / "nosuch", [{"question": "q"}], tmp_path, reward=reward_functions.shorter,
                   config=RlooConfig(k=1, eval_every=0, select="last"))


@pytest.mark.slow
def test_evaluate_from_python_scores_as_the_evaluate_stage_does(micro_run, micro_reward, tmp_path):
    """Two policies (the micro base model, named `mine`, and SFT) on the test split's rows in memory, with the
    reward model as the proxy, SFT as the KL reference and a reward function as the training reward: every
    figure `rloo evaluate` writes for them (run on the same rows as a prepared folder), and every figure the
    report adds from those records (intervals, pass@k, maj@k, the solution checker, the paired gain), equal
    to the digit."""
    from rloo.eval.at_k import completion_figures
    from rloo.eval.gains import correctness, gain
    from rloo.eval.records import read
    from rloo.model import models

    overlay = tmp_path / "reward.yaml"
    overlay.write_text(json.dumps({"reward": {"source": "function", "functions": [
        {"name": "shorter", "fn": SHORTER, "weight": 0.5}]}, "tracking": {"enabled": False},
        "progress_every_s": 0.001}))  # every pass reports its progress (a short one is otherwise silent)
    cfg = load_config([MICRO, overlay])
    policies = {"mine": micro_run["base_model"], "sft": micro_run["sft"]}
    rows = [dict(r) for r in read_split(micro_run["data"], "test")][: cfg["evaluate"]["examples"]]
    got = evaluate(policies, rows, against="sft", reference=micro_run["sft"], reward_model=micro_reward,
                   config=Config.from_config(cfg))
    rloo = Path(sys.executable).with_name("rloo")
    stage = {}
    for name, folder in policies.items():
        res = subprocess.run([str(rloo), "evaluate", "-c", str(MICRO), "-c", str(overlay), "--data", str(micro_run["data"]),
                              "--policy", f"{name}={folder}", "--sft", str(micro_run["sft"]), "--reward-model",
                              str(micro_reward), "--out", str(tmp_path / f"{name}.jsonl"), "--log", str(tmp_path / f"{name}.log")],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        stage[name] = read(name, tmp_path / f"{name}.jsonl")
    # the progress lines name the policy, not its folder's last part (base_model)
    assert "evaluate: mine, greedy" in (tmp_path / "mine.log").read_text()
    golds = stage["sft"].golds
    correct = {name: correctness(ev.texts(), golds) for name, ev in stage.items()}
    for name, ev in stage.items():
        expected = {**ev.summary["figures"], **completion_figures(ev.texts(), correct[name], golds)}
        assert got["policies"][name] == expected, name
        assert got["records"][name] == ev.records
    assert set(got["policies"]["mine"]["training_reward"]["parts"]) == {"shorter"}
    assert got["policies"]["mine"]["proxy_reward"] is not None and got["policies"]["mine"]["kl"] is not None
    assert got["gains"] == {"mine": gain(correct["mine"], correct["sft"], cfg["seed"])} and got["against"] == "sft"
    assert got["examples"] == len(rows) == cfg["evaluate"]["examples"]
    # a prepared folder reads the test split as the stage does, and a model object (training, as a caller's
    # may be) with its tokenizer scores as its folder: the same figures; the object is left training
    assert evaluate({"sft": micro_run["sft"]}, micro_run["data"], reference=micro_run["sft"], reward_model=micro_reward,
                    config=Config.from_config(cfg))["policies"]["sft"] == got["policies"]["sft"]
    model = models.load_causal_lm(micro_run["sft"])
    model.train()
    assert evaluate({"sft": model}, rows, tokenizer=models.load_tokenizer(micro_run["sft"]), reference=micro_run["sft"],
                    reward_model=micro_reward, config=Config.from_config(cfg))["policies"]["sft"] == got["policies"]["sft"]
    assert model.training


def test_evaluate_names_what_it_cannot_evaluate(micro_run, tmp_path):
    rows = [dict(r) for r in read_split(micro_run["data"], "test")][:2]
    with pytest.raises(InputError, match=r"against: 'rloo' is not one of the policies \(sft\)"):
        evaluate([micro_run["sft"]], rows, against="rloo")
    with pytest.raises(InputError, match=r"policies: name a model object"):
        evaluate([object()], rows)
    with pytest.raises(InputError, match=r"rows\[1\]: a row needs its question and answer"):
        evaluate({"sft": micro_run["sft"]}, [rows[0], {"question": "q"}])


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- python-api -->\n```python\n(.*?)```\n<!-- /python-api -->", text, re.S)
    assert block, "README.md: no ```python block between <!-- python-api --> markers"
    return block.group(1)


@pytest.mark.slow
def test_the_readme_snippet_runs_as_written(micro_run, tmp_path, monkeypatch, capsys):
    """It reads the quick start's folders: here the micro run's SFT policy and splits stand in for them."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k").symlink_to(micro_run["data"])
    (tmp_path / "results" / "models").mkdir(parents=True)
    (tmp_path / "results" / "models" / "sft").symlink_to(micro_run["sft"])
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_snippet(), "README.md", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["steps_trained"] > 0 and (tmp_path / "runs" / "rloo" / "model.safetensors").is_file()
    assert set(summary["reward_functions"]) == {"correct", "concise"}  # the tuple's name, the function's own
    printed = capsys.readouterr().out
    assert printed.count("\n") >= summary["steps_trained"]  # the log printed every step
    graded = namespace["graded"]  # both policies graded on the test split, the trained one against SFT
    assert set(graded["policies"]) == {"sft", "rloo"} and graded["examples"] == len(read_split(micro_run["data"], "test"))
    assert set(graded["gains"]) == {"rloo"} and len(graded["gains"]["rloo"]["sampled"]["ci95"]) == 2


def test_load_rows_reads_a_users_records_as_prepare_does(tmp_path, monkeypatch):
    """config/examples/your-data.yaml's files ({"id", "problem", "result": 85, "steps"}) through a real
    `prepare` run and through load_rows with the overlay's data.fields and data.answer_format: the same
    rows, from the file and from the records as a list of dicts."""
    monkeypatch.chdir(ROOT)  # the overlay names its files relative to the repository
    cfg = load_config(ROOT / "config" / "examples" / "your-data.yaml", {"tracking": {"enabled": False}})
    data = cfg["data"]
    shape = {"fields": data["fields"], "answer_format": data["answer_format"]}
    assert shape == {"fields": {"question": "problem", "answer": "result"}, "answer_format": "number"}
    prepare.run(cfg, tmp_path / "data")
    prepared = {split: read_split(tmp_path / "data", split) for split in ("train", "val", "test")}
    assert load_rows(data["test_file"], **shape) == prepared["test"]
    held_out = {r["id"] for r in prepared["val"]}
    rows = load_rows(ROOT / data["train_file"], **shape)  # a Path as well as a str
    assert [r for r in rows if r["id"] not in held_out] == prepared["train"]
    assert [r for r in rows if r["id"] in held_out] == prepared["val"]
    assert rows[0] == {"question": "Hana has 17 beads. Then Hana's beads become 5 times as many. How many beads "
                                   "does Hana have now?", "answer": "#### 85", "id": "train-0000", "steps": 1}
    records = [r for _, r in read_jsonl(data["test_file"])]
    assert load_rows(records, **shape) == prepared["test"]
    # a bad record names where it is and the field, as prepare's do
    with pytest.raises(DataError, match=r"^records\[1\]: field 'result' is not a number \(data.answer_format: "
                                        r"number\): 'about 4'$"):
        load_rows([records[0], {**records[1], "result": "about 4"}], **shape)
    with pytest.raises(DataError, match=r"^records\[0\]: missing field 'question'$"):
        load_rows(records)  # the pipeline's defaults: GSM8K's names
    assert load_rows([records[0], {"problem": "?"}], **shape, on_bad="skip") == prepared["test"][:1]
    with pytest.raises(InputError, match=r"^answer_format: 'bare' is not one of gsm8k, number \(data.answer_format\)$"):
        load_rows(records, fields=shape["fields"], answer_format="bare")
    with pytest.raises(InputError, match=r"^fields: \{'prompt': 'problem'\} names other keys than question and answer$"):
        load_rows(records, fields={"prompt": "problem"})


@pytest.mark.slow
def test_a_rerun_resumes_unless_the_reward_callables_file_changed(micro_run, tmp_path, caplog):
    """Issue 70: the API's checkpoint identity counts the user's file a reward callable lies in, by what
    it computes: the same call resumes its checkpoints, an edited body is refused in one line."""
    import dataclasses
    import importlib.util
    import logging


    def bonus_of(body: str):
        (tmp_path / "bonus.py").write_text(body)
        spec = importlib.util.spec_from_file_location("bonus", tmp_path / "bonus.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.bonus

    body = "def bonus(completions, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n"
    rows = training_prompts(read_split(micro_run["data"], "train"), 0)
    config = Config.from_config(micro_run["cfg"])
    config = dataclasses.replace(config, rloo=dataclasses.replace(config.rloo, steps=2, checkpoint_every=1,
                                                                  eval_every=0, select="last"))

    def train(reward) -> dict:
        return train_rloo(micro_run["sft"], rows, tmp_path / "out", reward=reward, config=config,
                          work_dir=tmp_path / "work")

    train(bonus_of(body))
    assert "resumed from" not in caplog.text
    with caplog.at_level(logging.INFO):
        train(bonus_of(body + "# a comment\n"))  # the same code
    assert "resumed from" in caplog.text
    # refused in one line naming what changed (rloo.identity.claim_work), the checkpoints kept
    with pytest.raises(InputError, match=r"another job \(changed: code; files .*bonus\.py\)"):
        train(bonus_of(body.replace("% 3", "% 5")))
    assert list((tmp_path / "work" / "checkpoints").iterdir())
