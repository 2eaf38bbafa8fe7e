"""GSM8K-format data: load from the hub, local JSONL or the generator; validate; format prompts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rloo.data.manifest import verify_split
from rloo.errors import MissingInputError, UserError
from rloo.io import jsonl_records, read_jsonl, text_lines
from rloo.reward.verifier import MARKER, extract_answer, normalize_number


class DataError(UserError, ValueError):
    """A record that is not valid GSM8K format; the message names the file and line."""


@dataclass
class LoadReport:
    kept: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    oversized: int = 0  # records over data.max_record_chars, dropped (data.on_oversized: drop)

    def skip(self, why: str) -> None:
        """Count a dropped record; the first 20 reasons are kept for the manifest."""
        self.skipped += 1
        if len(self.reasons) < 20:
            self.reasons.append(why)


@dataclass(frozen=True)
class SizeLimit:
    """The longest record a split may hold (data.max_record_chars), in characters of its JSON line, and
    what happens to a longer one (data.on_oversized): error stops, naming the first and the count; drop
    drops and counts them. A record far longer than any real problem is a broken export or an attack on the
    tokenizer and the stages' memory, and no training stage could use it."""

    max_chars: int
    on_oversized: str = "error"

    def dropped(self, sizes: Iterable[tuple[str, int]], report: LoadReport) -> set[str]:
        """The places (file:line, split[index]) of the records over the limit among (place, characters),
        counted in `report`; with `error` a DataError naming the first of them and their number."""
        over = [(where, n) for where, n in sizes if n > self.max_chars]
        if over and self.on_oversized == "error":
            where, n = over[0]
            more = f"; {len(over)} records of the split are over it" if len(over) > 1 else ""
            raise DataError(f"{where}: a record of {n:,} characters, over data.max_record_chars={self.max_chars:,}"
                            f"{more}; fix the data, or set data.on_oversized: drop to drop and count them")
        report.oversized += len(over)
        return {where for where, _ in over}


def record_chars(rec: dict) -> int:
    """A record's size as SizeLimit counts it where no line holds it (a hub row): its JSON line's characters."""
    return len(json.dumps(rec, ensure_ascii=False, default=str))


def line_chars(path: str) -> Iterator[tuple[str, int]]:
    """(file:line, characters) of each line of a JSONL file, its line break left out, read without parsing
    it (a line of megabytes costs no JSON object), a leading BOM left out as the JSONL reader leaves it."""
    for lineno, raw in text_lines(path):
        yield f"{path}:{lineno}", len(raw.rstrip(b"\r\n").decode("utf-8", errors="replace"))


# How a record names its question and answer (data.fields) and writes its answer (data.answer_format).
GSM8K_FIELDS = {"question": "question", "answer": "answer"}
# Values a prepared JSONL record can carry in its further fields (reward functions read them as columns).
_JSON_TYPES = (str, int, float, bool, list, dict, type(None))


def check_record(rec: dict, where: str, fields: dict[str, str] | None = None, answer_format: str = "gsm8k") -> dict:
    """The record as the pipeline reads it, {"question", "answer" (GSM8K form), every further field}, or a
    DataError naming `where` (file:line or split[index]). `fields` maps question and answer to the
    record's own keys; `answer_format` number takes a bare number and writes it as '#### N'."""
    q_key, a_key = (fields or GSM8K_FIELDS)["question"], (fields or GSM8K_FIELDS)["answer"]
    for role, key in (("question", q_key), ("answer", a_key)):
        if key not in rec:
            raise DataError(f"{where}: missing field '{key}'" + (f" (data.fields.{role})" if key != role else ""))
    question, answer = rec[q_key], rec[a_key]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field '{q_key}' must be a non-empty string")
    if answer_format == "number":
        number = None if isinstance(answer, bool) else normalize_number(str(answer))
        if number is None:
            raise DataError(f"{where}: field '{a_key}' is not a number (data.answer_format: number): {answer!r:.40}")
        answer = f"{MARKER} {number}"
    elif not isinstance(answer, str) or not answer.strip():
        raise DataError(f"{where}: field '{a_key}' must be a non-empty string")
    elif extract_answer(answer, "strict") is None:
        raise DataError(f"{where}: {a_key} has no parseable final '#### N'")
    extras = {k: v for k, v in rec.items() if k not in (q_key, a_key)}
    for key, value in extras.items():
        if key in GSM8K_FIELDS:
            raise DataError(f"{where}: field '{key}' would be replaced by field '{fields and fields[key]}' "
                            f"(data.fields.{key}); rename one of them")
        if not isinstance(value, _JSON_TYPES):
            raise DataError(f"{where}: field '{key}' holds a {type(value).__name__}, which a JSONL record cannot hold")
    return {"question": question.strip(), "answer": answer.strip(), **extras}


def _collect(records, on_bad: str, report: LoadReport, fields: dict[str, str] | None = None,
             answer_format: str = "gsm8k", dropped: set[str] = frozenset()) -> list[dict]:
    out = []
    for where, rec in records:
        if where in dropped:
            continue
        try:
            out.append(check_record(rec, where, fields, answer_format))
        except DataError as e:
            if on_bad == "error":
                raise
            report.skip(str(e))
    report.kept = len(out)
    return out


def _jsonl_records(path: str, on_bad: str, report: LoadReport, dropped: set[str] = frozenset()):
    """(file:line, record) pairs; a bad line raises, or with on_bad=skip is counted and dropped; a line in
    `dropped` (oversized) is passed over."""
    for lineno, rec, bad in jsonl_records(path):
        if f"{path}:{lineno}" in dropped:
            continue
        if bad is None:
            yield f"{path}:{lineno}", rec
        elif on_bad == "error":
            raise DataError(bad)
        else:
            report.skip(bad)


def load_jsonl_split(path: str, on_bad: str = "error", fields: dict[str, str] | None = None,
                     answer_format: str = "gsm8k", limit: SizeLimit | None = None) -> tuple[list[dict], LoadReport]:
    """Local files in the official GSM8K release format, one {"question","answer"} per line (or the
    keys `fields` names, the answer as `answer_format` says: `check_record`); lines longer than `limit`
    refused or dropped before any is parsed.

    Lines are checked by our own reader first, so that an error names the line; the file then goes
    through `datasets.load_dataset("json")`, the same loader a user's own JSON data set takes.
    """
    if not Path(path).exists():
        raise DataError(f"{path}: file not found")
    report = LoadReport()
    dropped = limit.dropped(line_chars(path), report) if limit else set()
    records = _collect(_jsonl_records(path, on_bad, report, dropped), on_bad, report, fields, answer_format)
    if not records:
        why = (f"all {report.skipped} records are invalid ({report.reasons[0]})" if report.skipped else
               f"all {report.oversized} records are over data.max_record_chars" if report.oversized else
               "the file holds no records")
        raise DataError(f"{path}: no usable GSM8K records: {why}")
    if report.skipped == 0 and report.oversized == 0:  # else the loader's rows are not the lines kept
        import datasets

        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as e:  # pyarrow's: a field whose values differ in type from line to line
            raise DataError(f"{path}: datasets cannot read it as one table ({' '.join(str(e).split())[:200]})") from None
        if len(ds) != len(records):
            raise DataError(f"{path}: datasets read {len(ds)} rows but {len(records)} valid records")
        records = [check_record(dict(r), f"{path}:{i + 1}", fields, answer_format) for i, r in enumerate(ds)]
    return records, report


def load_records(rows: Iterable[Mapping], name: str, on_bad: str = "error", fields: dict[str, str] | None = None,
                 answer_format: str = "gsm8k", limit: SizeLimit | None = None) -> tuple[list[dict], LoadReport]:
    """Records already in memory (a hub split, a caller's list), each checked as a JSONL line is
    (`check_record`; `limit`: data.max_record_chars, on each record's JSON); an error names `name[index]`."""
    report = LoadReport()
    named = [(f"{name}[{i}]", dict(r)) for i, r in enumerate(rows)]
    dropped = limit.dropped(((where, record_chars(r)) for where, r in named), report) if limit else set()
    return _collect(named, on_bad, report, fields, answer_format, dropped), report


def load_hub_split(
    hub_id: str, config: str, split: str, on_bad: str = "error", fields: dict[str, str] | None = None,
    answer_format: str = "gsm8k", limit: SizeLimit | None = None,
) -> tuple[list[dict], LoadReport]:
    """A split of a hub data set such as openai/gsm8k (needs network access to the hub)."""
    import datasets

    return load_records(datasets.load_dataset(hub_id, config, split=split), f"{hub_id}[{split}]", on_bad, fields,
                        answer_format, limit)


def solution_steps(answer: str) -> int:
    """Reasoning lines of a reference solution: the non-empty lines before the final '#### N'."""
    body = answer.rsplit("####", 1)[0]
    return sum(1 for line in body.splitlines() if line.strip())


def format_prompt(question: str, template: str) -> str:
    return template.format(question=question)


def format_completion(answer: str) -> str:
    """The SFT target that follows the prompt; the tokenizer's EOS is appended by the caller."""
    return " " + answer


class Row(dict):
    """A prepared record that knows where it was read (`where`: data/gsm8k/train.jsonl:12, the file and its
    1-based line), so that a later stage's error about it cites that; a plain dict to everything else (the
    reward functions' columns are its keys)."""

    where: str | None = None


def cite(row: dict, index: int, rows: str = "prompts") -> str:
    """Where a row came from: its file:line when a split was read (`Row`), else its place among the `rows`
    handed in from Python (rloo.api: `prompts[3]`)."""
    return getattr(row, "where", None) or f"{rows}[{index}]"


def read_split(data_dir: str | Path, name: str) -> list[dict]:
    """The records of `<data_dir>/<name>.jsonl` (train, val or test), each a `Row` citing its line; an error
    naming a missing split or one whose bytes differ from the manifest's record of them (rloo.data.manifest)."""
    data_dir = Path(data_dir)
    path = data_dir / f"{name}.jsonl"
    if not path.is_file():
        raise MissingInputError(f"{path}: no {name} split; run `rloo prepare` (this data folder predates it)")
    rows = []
    for lineno, rec in read_jsonl(verify_split(data_dir, name)):
        row = Row(rec)
        row.where = f"{path}:{lineno}"
        rows.append(row)
    return rows
