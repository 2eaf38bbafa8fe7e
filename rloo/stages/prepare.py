"""Prepare GSM8K-format prompt splits: the embedded generator, a hub data set, or local JSONL files."""

from __future__ import annotations

import collections
import logging
from pathlib import Path

from rloo.config import config_hash
from rloo.data import gsm8k, synthetic
from rloo.io import sha256_file, write_json_atomic, write_jsonl_atomic

log = logging.getLogger("rloo.prepare")


def load_splits(cfg: dict) -> tuple[list[dict], list[dict], dict]:
    """(train, test, source info) for the configured source."""
    d = cfg["data"]
    if d["source"] == "synthetic":
        s = d["synthetic"]
        train, test = synthetic.generate(
            s["n_train"], s["n_test"], cfg["seed"], s["step_weights"], s["max_number"]
        )
        info = {
            "source": "synthetic",
            "generator": dict(s),
            "steps_histogram": {
                split: dict(sorted(collections.Counter(r["steps"] for r in rows).items()))
                for split, rows in (("train", train), ("test", test))
            },
        }
        strip = lambda rows: [{"question": r["question"], "answer": r["answer"]} for r in rows]  # noqa: E731
        return strip(train), strip(test), info
    if d["source"] == "hub":
        train, rep_tr = gsm8k.load_hub_split(d["hub_id"], d["hub_config"], "train", d["on_bad_record"])
        test, rep_te = gsm8k.load_hub_split(d["hub_id"], d["hub_config"], "test", d["on_bad_record"])
        info = {"source": "hub", "hub_id": d["hub_id"], "hub_config": d["hub_config"]}
    else:
        for key in ("train_file", "test_file"):
            if not d[key]:
                raise ValueError(f"data.{key} must be set when data.source is 'jsonl'")
        train, rep_tr = gsm8k.load_jsonl_split(d["train_file"], d["on_bad_record"])
        test, rep_te = gsm8k.load_jsonl_split(d["test_file"], d["on_bad_record"])
        info = {
            "source": "jsonl",
            "train_file": d["train_file"],
            "test_file": d["test_file"],
            "input_sha256": {"train": sha256_file(d["train_file"]), "test": sha256_file(d["test_file"])},
        }
    info["skipped"] = {"train": rep_tr.skipped, "test": rep_te.skipped}
    info["skip_reasons"] = rep_tr.reasons + rep_te.reasons
    for split, rep in (("train", rep_tr), ("test", rep_te)):
        if rep.skipped:
            log.warning("%s: skipped %d bad records (data.on_bad_record=skip)", split, rep.skipped)
    return train, test, info


def run(cfg: dict, out_dir: str | Path) -> dict:
    """Write train.jsonl, test.jsonl and manifest.json under `out_dir`."""
    out = Path(out_dir)
    train, test, info = load_splits(cfg)
    d = cfg["data"]
    if d["max_train"]:
        train = train[: d["max_train"]]
    if d["max_test"]:
        test = test[: d["max_test"]]
    test_questions = {r["question"] for r in test}
    overlap = sum(r["question"] in test_questions for r in train)
    if not train or not test:
        raise ValueError(f"data: empty split (train={len(train)}, test={len(test)})")
    write_jsonl_atomic(out / "train.jsonl", train)
    write_jsonl_atomic(out / "test.jsonl", test)
    manifest = {
        **info,
        "seed": cfg["seed"],
        "counts": {"train": len(train), "test": len(test)},
        "train_test_overlap": overlap,
        "sha256": {"train": sha256_file(out / "train.jsonl"), "test": sha256_file(out / "test.jsonl")},
        "config_hash": config_hash(cfg, ["seed", "data"]),
    }
    write_json_atomic(out / "manifest.json", manifest)
    log.info("prepared %d train / %d test records from %s", len(train), len(test), info["source"])
    return manifest
