"""rloo.io's atomic writes when the write itself fails: one WriteError naming the output and the free
space, the temporary sibling removed, the previous output untouched; an error that is not a failed
write passes through as it is."""

from __future__ import annotations

import json
import re

import pytest
import torch
from fault_helpers import file_size_limit

from rloo.eval import records as eval_records
from rloo.io import WriteError, atomic_dir, write_json_atomic


def test_a_results_file_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    out = tmp_path / "results" / "gsm8k_rloo.json"
    write_json_atomic(out, {"before": 1})
    with file_size_limit(64), pytest.raises(WriteError) as e:
        write_json_atomic(out, {"policies": "x" * 1000})
    assert re.fullmatch(rf"could not write {re.escape(str(out))}: File too large \(\d+ MiB free there\); the partial "
                        r"output was removed: free some space \(or fix the file system\) and rerun", str(e.value))
    assert json.loads(out.read_text()) == {"before": 1}
    assert sorted(p.name for p in out.parent.iterdir()) == ["gsm8k_rloo.json"]


def test_a_torch_stream_failure_in_a_folder_names_the_folder(tmp_path):
    expected = rf"could not write {re.escape(str(tmp_path / 'ck'))}: the writer failed \(.*unexpected pos.*older ones"
    with file_size_limit(4096), pytest.raises(WriteError, match=expected), \
            atomic_dir(tmp_path / "ck", kept="; older ones are kept") as tmp:
        torch.save({"w": torch.zeros(10_000)}, tmp / "optimizer.pt")
    assert list(tmp_path.iterdir()) == []


def test_an_error_that_is_not_a_failed_write_passes_through(tmp_path):
    with pytest.raises(KeyError), atomic_dir(tmp_path / "out"):
        raise KeyError("a bug")
    with pytest.raises(FileNotFoundError), atomic_dir(tmp_path / "out"):
        (tmp_path / "missing").read_text()  # reading a missing input is no write failure
    with pytest.raises(RuntimeError, match="shape mismatch"), atomic_dir(tmp_path / "out"):
        raise RuntimeError("shape mismatch")
    assert list(tmp_path.iterdir()) == []


def _pair(folder):
    """What of an evaluation's two files is there: {name: content}."""
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_a_failed_evaluation_write_keeps_or_removes_its_records_and_figures_together(tmp_path):
    """Issue 71: the second of the two files failing (a full disk: a file-size limit its records pass and
    its figures do not; a records path that is a folder) leaves both files or neither, never one."""
    records = [{"question": f"q{i}", "answer": "#### 4", "greedy": {"text": "x" * 200}} for i in range(20)]
    summary = {"accuracy": 0.5}
    fresh, kept, blocked = (tmp_path / name / "eval" for name in ("fresh", "kept", "blocked"))
    for folder in (fresh, kept, blocked):
        folder.mkdir(parents=True)

    # no earlier pair: a full disk on the records leaves neither file
    with file_size_limit(1024), pytest.raises(WriteError, match=re.escape(str(fresh / "rloo.jsonl"))):
        eval_records.write(fresh / "rloo.jsonl", records, summary)
    assert _pair(fresh) == {}

    # an earlier run's pair: kept as it was, both
    eval_records.write(kept / "rloo.jsonl", records[:1], {"accuracy": 0.0})
    before = _pair(kept)
    with file_size_limit(1024), pytest.raises(WriteError):
        eval_records.write(kept / "rloo.jsonl", records, summary)
    assert _pair(kept) == before and set(before) == {"rloo.json", "rloo.jsonl"}

    # the records' path a folder: the figures, replaced first, are removed again
    (blocked / "rloo.jsonl").mkdir()
    with pytest.raises(IsADirectoryError):
        eval_records.write(blocked / "rloo.jsonl", records, summary)
    assert [p.name for p in blocked.iterdir()] == ["rloo.jsonl"] and not any((blocked / "rloo.jsonl").iterdir())
