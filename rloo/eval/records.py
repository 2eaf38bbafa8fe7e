"""One policy's evaluation, as the evaluate stage writes it and the report, the judge and the comparison read
it: a line per held-out problem (`<results>/eval/<policy>.jsonl`), and the policy's figures beside it
(`<policy>.json`).

A problem's line holds its question and gold answer, the greedy completion and every sampled draw, each
with its tokens, whether it ended within the budget, the verifier's grade (strict and flexible) and the
solution checker's (its `<<expr=value>>` annotations and how many are wrong); a draw also its KL to the
reference, the proxy reward model's score and the training reward's parts, where the evaluation has them.
With `tools.evaluate_without`, the line also holds the same problem's greedy completion and draws decoded
without the tools (`without_tools`), graded alike.
So a person can read what a policy wrote and how each completion was graded, and every figure that
compares policies (a gain, a win rate, pass@k) is computed from these files alone, loading no model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.io import dump_json, dump_jsonl, read_jsonl, write_together
from rloo.reward.solution_check import check
from rloo.reward.verifier import is_correct


def _graded(text: str, gold: str) -> dict[str, Any]:
    checked = check(text, gold)
    return {"correct": checked.right_answer, "correct_flexible": is_correct(text, gold, "flexible"),
            "annotations": checked.annotations, "wrong_annotations": checked.wrong_annotations}


def problem_records(rows: list[dict], texts: dict[str, Any],
                    reward_parts: list[dict[str, list[float | None]]] | None = None) -> list[dict]:
    """A line per problem of `rows` from evaluate_policy's completions (`texts`) and the training reward's
    parts (`reward_parts`: one {part: rewards of every problem} per draw), graded; with the completions of
    a pass without the tools (`texts["without_tools"]`, rloo.eval.evaluation.evaluate_with_records), those
    too, graded alike, under the line's `without_tools`."""
    out = []
    for i, row in enumerate(rows):
        line = {"question": row["question"], "answer": row["answer"], **_completions(texts, i, row["answer"], reward_parts)}
        if "without_tools" in texts:
            line["without_tools"] = _completions(texts["without_tools"], i, row["answer"])
        out.append(line)
    return out


def _completions(texts: dict[str, Any], i: int, gold: str,
                 reward_parts: list[dict[str, list[float | None]]] | None = None) -> dict[str, Any]:
    """Problem `i`'s greedy completion and sampled draws, graded: {"greedy", "draws"}."""
    draws = []
    for j, text in enumerate(texts["draws"][i]):
        draw = {"text": text, "tokens": texts["draw_lengths"][i][j], "finished": texts["draw_finished"][i][j],
                **_graded(text, gold)}
        if texts.get("draw_kl") is not None:
            draw["kl"] = texts["draw_kl"][i][j]
        if texts.get("draw_proxy") is not None:
            draw["proxy"] = texts["draw_proxy"][i][j]
        if reward_parts is not None:
            draw["reward"] = {name: values[i] for name, values in reward_parts[j].items()}
        draws.append(draw)
    greedy = {"text": texts["greedy"][i], "tokens": texts["greedy_lengths"][i],
              "finished": texts["greedy_finished"][i], **_graded(texts["greedy"][i], gold)}
    return {"greedy": greedy, "draws": draws}


def write(records_path: str | Path, records: list[dict], summary: dict) -> None:
    """The records and, beside them (`summary_path`), the policy's figures, both or neither: a write that
    fails (a full disk) leaves no figures without their records, nor records without their figures."""
    write_together([(summary_path(records_path), lambda tmp: dump_json(tmp, summary)),
                    (records_path, lambda tmp: dump_jsonl(tmp, records))])


def summary_path(records_path: str | Path) -> Path:
    """The policy's figures beside its records: `<policy>.json` beside `<policy>.jsonl`."""
    return Path(records_path).with_suffix(".json")


@dataclass(frozen=True)
class PolicyRecords:
    """One policy's evaluation read back: its records and its figures."""

    name: str
    records: list[dict]
    summary: dict

    @property
    def questions(self) -> list[str]:
        return [r["question"] for r in self.records]

    @property
    def golds(self) -> list[str]:
        return [r["answer"] for r in self.records]

    def texts(self) -> dict[str, Any]:
        """The completions by decoding mode, as evaluate_policy hands them: `greedy`, `sampled` (the first
        draw, what a pairwise judge compares), `draws` (each problem's); and, where the evaluation decoded
        a second time without the tools, `without_tools`: the same three of that pass."""
        out = _texts(self.records)
        if self.records and "without_tools" in self.records[0]:
            out["without_tools"] = _texts([r["without_tools"] for r in self.records])
        return out


def _texts(records: list[dict]) -> dict[str, list]:
    return {"greedy": [r["greedy"]["text"] for r in records],
            "sampled": [r["draws"][0]["text"] for r in records],
            "draws": [[d["text"] for d in r["draws"]] for r in records]}


def read(name: str, records_path: str | Path, summary: str | Path | None = None) -> PolicyRecords:
    """Policy `name`'s records and figures (`summary`: default beside the records)."""
    records = [rec for _, rec in read_jsonl(records_path)]
    return PolicyRecords(name, records, json.loads(Path(summary or summary_path(records_path)).read_text()))
