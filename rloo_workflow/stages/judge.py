"""`rloo judge`: an LLM judge's verdicts on trained policies' completions against a baseline's, read from
their evaluations' records (rloo.eval.records), for the report (evaluate.judge: llm).

A served judge (evaluate.llm_judge.serve) is started once for every pair the job judges, and stopped on
every way out; one that cannot start, or fails more often than evaluate.llm_judge.max_failed_share
allows, stops the job before it writes anything. The verifier needs no job: the report computes its
win rates itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rloo.errors import InputError
from rloo.eval.gains import judged_win_rate
from rloo.eval.records import PolicyRecords
from rloo.io import write_json_atomic
from rloo.progress import Progress
from rloo.settings import Config
from rloo_workflow.judge_server import open_judge

log = logging.getLogger("rloo.judge")


def judge_pairs(judge, candidates: dict[str, PolicyRecords], baseline: PolicyRecords, mode: str,
                progress_every_s: float) -> dict[str, dict]:
    """{name: its win rate against `baseline` by `judge`} on each candidate's `mode` completions (greedy or
    the first sampled draw), problem by problem: the same problems in the same order, or an error. Each
    pair's problems judged so far on a progress line every `progress_every_s` seconds."""
    out = {}
    for name, ev in candidates.items():
        if ev.questions != baseline.questions:
            raise InputError(f"the {name} evaluation holds other problems than {baseline.name}'s: evaluate both "
                             "on the same data")
        with Progress(f"judge: {name} vs {baseline.name}", len(ev.questions), progress_every_s,
                      unit="problem") as progress:
            out[name] = judged_win_rate(judge, ev.questions, ev.golds, ev.texts()[mode], baseline.texts()[mode],
                                        progress)
        log.info("%s vs %s: %s", name, baseline.name, out[name])
    return out


def run(cfg: dict, candidates: dict[str, PolicyRecords], baseline: PolicyRecords, out_json: str | Path,
        judge_log: str | Path, reserved_gpus: int = 0) -> dict:
    """Judge each of `candidates` against `baseline` with the configured judge; write the verdicts' record
    (`{"judge": its description, decoding and calls, "win_rates": {name: ...}}`) to `out_json`. The job
    holds no policy: the served judge takes all its GPUs but `reserved_gpus`."""
    settings = Config.of(cfg)
    mode = settings.evaluate.win_rate_decoding
    with open_judge(cfg, judge_log, reserved_gpus=reserved_gpus) as judge:
        wins = judge_pairs(judge, candidates, baseline, mode, settings.progress_every_s)
        calls = judge.check()  # too many failed calls stop the job here, before any output
        record = {"judge": {**getattr(judge, "description", {"type": judge.name}), "decoding": mode, **calls},
                  "win_rates": wins}
    write_json_atomic(out_json, record)
    return record
