"""Prepare GSM8K-format prompt splits: the embedded generator, a hub data set, or local JSONL files."""

from __future__ import annotations

import collections
import logging
import random
from pathlib import Path

from rloo.data import contamination, gsm8k, synthetic
from rloo.data.contamination import Overlap
from rloo.errors import InputError
from rloo.io import sha256_file, write_json_atomic, write_jsonl_atomic
from rloo.settings import Config
from rloo_workflow.config import config_hash

log = logging.getLogger("rloo.prepare")


def load_splits(cfg: dict) -> tuple[list[dict], list[dict], list[dict], dict]:
    """(train, test, validation, source info) for the configured source.

    The validation split (`data.val_examples` problems, for model selection during training) is disjoint
    from test: generated after train and test by the embedded generator, else held out of the train split.
    """
    config = Config.of(cfg)
    d = config.data
    if d.source == "synthetic":
        s = d.synthetic
        train, test, val = synthetic.generate(
            s.n_train, s.n_test, config.seed, list(s.step_weights), s.max_number, s.max_value, n_val=d.val_examples,
        )
        info = {
            "source": "synthetic",
            "generator": s.to_config(),
            "steps_histogram": {
                split: dict(sorted(collections.Counter(r["steps"] for r in rows).items()))
                for split, rows in (("train", train), ("test", test), ("val", val))
            },
        }
        strip = lambda rows: [{"question": r["question"], "answer": r["answer"]} for r in rows]  # noqa: E731
        split_rows, info["duplicates"] = check_duplicates(
            {"train": strip(train), "test": strip(test), "val": strip(val)}, d.on_duplicates,
            {split: f"data.synthetic ({split} split)" for split in SPLITS})
        return split_rows["train"], split_rows["test"], split_rows["val"], info
    shape = {"fields": d.fields.to_config(), "answer_format": d.answer_format,  # how the records name and write them
             "limit": gsm8k.SizeLimit(d.max_record_chars, d.on_oversized)}
    if d.source == "hub":
        train, rep_tr = gsm8k.load_hub_split(d.hub_id, d.hub_config, "train", d.on_bad_record, **shape)
        test, rep_te = gsm8k.load_hub_split(d.hub_id, d.hub_config, "test", d.on_bad_record, **shape)
        info = {"source": "hub", "hub_id": d.hub_id, "hub_config": d.hub_config}
        where = {split: f"{d.hub_id}[{split}]" for split in ("train", "test")}
    else:
        for key in ("train_file", "test_file"):
            if not getattr(d, key):
                raise InputError(f"data.{key} must be set when data.source is 'jsonl'")
        train, rep_tr = gsm8k.load_jsonl_split(d.train_file, d.on_bad_record, **shape)
        test, rep_te = gsm8k.load_jsonl_split(d.test_file, d.on_bad_record, **shape)
        info = {
            "source": "jsonl",
            "train_file": d.train_file,
            "test_file": d.test_file,
            "input_sha256": {"train": sha256_file(d.train_file), "test": sha256_file(d.test_file)},
        }
        where = {"train": d.train_file, "test": d.test_file}
    info["skipped"] = {"train": rep_tr.skipped, "test": rep_te.skipped}
    info["skip_reasons"] = rep_tr.reasons + rep_te.reasons
    info["oversized"] = {"train": rep_tr.oversized, "test": rep_te.oversized}
    for split, rep in (("train", rep_tr), ("test", rep_te)):
        if rep.skipped:
            log.warning("%s: skipped %d bad records (data.on_bad_record=skip)", split, rep.skipped)
        if rep.oversized:
            log.warning("!!! %s: dropped %d records over data.max_record_chars=%d (data.on_oversized=drop)", split,
                        rep.oversized, d.max_record_chars)
    split_rows, info["duplicates"] = check_duplicates({"train": train, "test": test}, d.on_duplicates, where)
    train, val = hold_out(split_rows["train"], d.val_examples, config.seed)
    return train, split_rows["test"], val, info


def hold_out(rows: list[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(rest, validation): a validation split carved out of a train split, n questions drawn at random,
    each with every record that asks it once normalised (rloo.data.contamination), so that no copy of a
    validation problem stays in train (with data.on_duplicates: keep, one question's copies all go to the
    one side, and validation holds them all). Without copies it draws the n records a draw of records
    would: a split prepared before questions were grouped is prepared the same."""
    questions: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        questions.setdefault(contamination.normalised(r["question"]), []).append(i)
    if n >= len(questions):
        distinct = f", {len(questions)} distinct questions" if len(questions) < len(rows) else ""
        raise InputError(f"data.val_examples={n} leaves no training records (the train split has {len(rows)}"
                         f"{distinct})")
    picked = {i for group in random.Random(seed).sample(list(questions.values()), n) for i in group}
    return [r for i, r in enumerate(rows) if i not in picked], [r for i, r in enumerate(rows) if i in picked]


SPLITS = ("train", "test", "val")
SHOWN = 3  # overlapping problems quoted in the error


def _quoted(questions: list[str]) -> str:
    return "; ".join(repr(q if len(q) <= 60 else q[:57] + "...") for q in questions[:SHOWN])


def check_duplicates(split_rows: dict[str, list[dict]], on: str, where: dict[str, str]) -> tuple[dict, dict]:
    """The splits less the records that repeat an earlier one of their split (rloo.data.contamination.
    duplicates) with `data.on_duplicates` drop, all kept with keep, and their count as the manifest records
    it ({mode, exact: {split: n}, normalised: {split: n}}); with error, a refusal naming the split's file
    (`where`) and the count. A repeated problem weighs more in training, or in the test accuracy."""
    found = {split: contamination.duplicates(rows) for split, rows in split_rows.items()}
    for split, dup in found.items():
        if dup and on == "error":
            first = [split_rows[split][i]["question"] for i in sorted(dup.exact + dup.normalised)]
            raise InputError(f"{where[split]}: {len(dup)} duplicate records ({len(dup.exact)} exact copies of an "
                             f"earlier record, {len(dup.normalised)} with an earlier record's question once "
                             f"normalised; first: {_quoted(first)}); remove them, or set data.on_duplicates: drop "
                             "or keep")
    kept = {split: found[split].dropped(rows) if on == "drop" else rows for split, rows in split_rows.items()}
    return kept, {"mode": on, "exact": {split: len(dup.exact) for split, dup in found.items()},
                  "normalised": {split: len(dup.normalised) for split, dup in found.items()}}


def duplicates_line(counts: dict) -> str:
    """The manifest's duplicate count in words, for prepare's last line: '' when there are none."""
    total = sum(counts["exact"].values()) + sum(counts["normalised"].values())
    if not total:
        return ""
    per_split = ", ".join(f"{split} {counts['exact'][split]} exact + {counts['normalised'][split]} normalised"
                          for split in counts["exact"] if counts["exact"][split] or counts["normalised"][split])
    done = {"drop": "dropped", "keep": "kept"}[counts["mode"]]
    return f"; {done} {total} duplicate records ({per_split}; data.on_duplicates: {counts['mode']})"


def check_overlap(train: list[dict], found: Overlap, allowed: bool) -> int:
    """The training problems whose question is also a test question once both are normalised
    (rloo.data.contamination): an error naming their count and the first few (a held-out accuracy on
    problems trained on measures nothing), or with `data.allow_train_test_overlap` a warning; the count
    either way."""
    shared = [train[i]["question"] for i in found.exact]
    if not shared:
        return 0
    what = (f"data: {len(shared)} training problems also occur in the test split (compared with case, whitespace, "
            f"punctuation and number formatting normalised; first: {_quoted(shared)}), so the held-out accuracy "
            "would be measured on problems the policy was trained on")
    if not allowed:
        raise InputError(f"{what}; remove them from the training data, or set data.allow_train_test_overlap: true "
                         "to proceed with a warning")
    log.warning("!!! %s (data.allow_train_test_overlap: true); the manifest and the results record the count", what)
    return len(shared)


def check_ngram_overlap(train: list[dict], found: Overlap, n: int, on: str) -> dict | None:
    """The training problems that share a run of `n` normalised words with a test problem, as the manifest
    records them ({words, count, mode}; None with the check off): with `data.on_ngram_overlap` error a refusal
    naming the count and the first few, with warn a `!!!` line, with count an info line."""
    if found.ngram is None:
        return None
    shared = [train[i]["question"] for i in found.ngram]
    if shared:
        what = (f"data: {len(shared)} training problems share a run of {n} words with a test problem once normalised "
                f"(data.ngram_overlap_words; first: {_quoted(shared)})")
        if on == "error":
            raise InputError(f"{what}; remove them from the training data, or set data.on_ngram_overlap: warn or count")
        if on == "warn":
            log.warning("!!! %s (data.on_ngram_overlap: warn); the manifest and the results record the count", what)
        else:
            log.info("%s (data.on_ngram_overlap: count)", what)
    return {"words": n, "count": len(shared), "mode": on}


def run(cfg: dict, out_dir: str | Path) -> dict:
    """Write train.jsonl, test.jsonl, val.jsonl and manifest.json under `out_dir`."""
    out = Path(out_dir)
    train, test, val, info = load_splits(cfg)
    config = Config.of(cfg)
    d = config.data
    if d.max_train:
        train = train[: d.max_train]
    if d.max_test:
        test = test[: d.max_test]
    splits = dict(zip(SPLITS, (train, test, val), strict=True))
    if not all(splits.values()):
        raise InputError(f"data: empty split ({', '.join(f'{k}={len(v)}' for k, v in splits.items())})")
    test_questions = [r["question"] for r in test]
    # Selection on validation must never see a test problem, nor be made on a training one.
    for other, rows in (("test", test), ("train", train)):
        shared = len(contamination.overlap([r["question"] for r in val], [r["question"] for r in rows]).exact)
        if shared:
            raise InputError(f"data: {shared} validation questions also occur in the {other} split (compared with "
                             "case, whitespace, punctuation and number formatting normalised)")
    found = contamination.overlap([r["question"] for r in train], test_questions, d.ngram_overlap_words)
    overlap = check_overlap(train, found, d.allow_train_test_overlap)
    ngram = check_ngram_overlap(train, found, d.ngram_overlap_words, d.on_ngram_overlap)
    for name, rows in splits.items():
        write_jsonl_atomic(out / f"{name}.jsonl", rows)
    manifest = {
        **info,
        "seed": config.seed,
        "counts": {k: len(v) for k, v in splits.items()},
        "train_test_overlap": overlap,
        "train_test_ngram_overlap": ngram,
        "sha256": {k: sha256_file(out / f"{k}.jsonl") for k in SPLITS},
        "config_hash": config_hash(config.to_config(), ["seed", "data"]),
    }
    write_json_atomic(out / "manifest.json", manifest)
    log.info("prepared %d train / %d test / %d validation records from %s%s", len(train), len(test), len(val),
             info["source"], duplicates_line(info["duplicates"]))
    return manifest
