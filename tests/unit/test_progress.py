"""rloo/progress.py: a long stage's progress lines, at most one every `progress_every_s`, on the log and on
stdout where stdout is another file (the terminal of a Snakemake job)."""

from __future__ import annotations

import itertools
import logging
import re
import time

import pytest

from rloo.progress import Progress, duration, speed
from rloo_workflow.config import ConfigError, load_config

LINE = re.compile(r"^rloo: step (\d+)/8 \((\d+)%\) · reward 0\.5 · kl 0\.1 · [\d.]+ (s/step|steps/s) · (ETA|took) \d+ s$")


def test_a_line_at_most_every_interval_and_a_last_one_at_the_end(capfd, caplog):
    caplog.set_level(logging.INFO, "rloo.progress")
    with Progress("rloo", 8, every_s=0.05, initial=2) as progress:  # a run resumed after 2 steps
        for _ in range(6):
            time.sleep(0.03)
            progress.update(1, reward="0.5", kl="0.1")
    out = capfd.readouterr().out.splitlines()
    assert len(out) >= 2, out
    # the interval apart (the last line, at the end, whenever the pass ends)
    times = [r.created for r in caplog.records][:-1]
    assert all(b - a >= 0.049 for a, b in itertools.pairwise(times)), times
    steps = [int(LINE.match(line).group(1)) for line in out]
    assert steps == sorted(set(steps)) and steps[0] > 2 and steps[-1] == 8, out
    assert out[-1].endswith(" s") and "took" in out[-1] and all("ETA" in line for line in out[:-1]), out
    assert [r.getMessage() for r in caplog.records] == out  # the log has the same lines


def test_a_pass_shorter_than_the_interval_writes_nothing(capfd, caplog):
    caplog.set_level(logging.INFO, "rloo.progress")
    with Progress("evaluate: sft, greedy", 16, every_s=30, unit="problem") as progress:
        progress.update(16)
    assert capfd.readouterr().out == "" and not caplog.records
    off = Progress("rloo", 4, every_s=0)  # a data-parallel run's other ranks count, and write nothing
    off.enabled = False
    off.update(4)
    off.close()
    assert capfd.readouterr().out == ""


def test_the_pace_and_the_wait_read_as_a_person_reads_them():
    assert speed(1.4, "step") == "1.4 s/step" and speed(0.08, "step") == "12.5 steps/s"
    assert duration(45) == "45 s" and duration(8 * 60) == "8 min" and duration(150 * 60) == "2.5 h"


@pytest.mark.parametrize("value", [0, -1])
def test_the_interval_must_be_positive(value):
    with pytest.raises(ConfigError, match="progress_every_s"):
        load_config(None, {"progress_every_s": value})


def test_the_pace_follows_a_machine_that_got_faster(monkeypatch, capfd):
    """A job slowed by another beside it, then alone: within a few lines the pace and the ETA are the new
    ones, not the mean since the start (3 s/step for 20 steps, then 0.3 s/step: after 200 steps the mean
    says 0.57 s/step)."""
    clock = [0.0]
    monkeypatch.setattr("rloo.progress.time.monotonic", lambda: clock[0])
    with Progress("sft", 400, every_s=10) as progress:
        for step in range(200):
            clock[0] += 3.0 if step < 20 else 0.3
            progress.update(1)
    last = capfd.readouterr().out.splitlines()[-1]
    pace = re.search(r"^sft: step 200/400 \(50%\) · ([\d.]+) steps/s · ETA (.+)$", last)
    assert pace and 3.2 <= float(pace.group(1)) <= 3.4, last  # 0.3 s/step, not the mean's 1.8 steps/s
    assert pace.group(2) == "1 min", last  # 200 steps left at 0.3 s, not the mean's 2 min
