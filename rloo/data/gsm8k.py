"""GSM8K-format data: load from the hub, local JSONL or the generator; validate; format prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rloo.data.manifest import verify_split
from rloo.errors import MissingInputError, UserError
from rloo.io import jsonl_records, read_jsonl
from rloo.reward.verifier import extract_answer


class DataError(UserError, ValueError):
    """A record that is not valid GSM8K format; the message names the file and line."""


@dataclass
class LoadReport:
    kept: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def skip(self, why: str) -> None:
        """Count a dropped record; the first 20 reasons are kept for the manifest."""
        self.skipped += 1
        if len(self.reasons) < 20:
            self.reasons.append(why)


def check_record(rec: dict, where: str) -> dict:
    """Return {"question", "answer"} or raise DataError naming `where` (file:line or split[index])."""
    for key in ("question", "answer"):
        if key not in rec:
            raise DataError(f"{where}: missing field '{key}'")
        if not isinstance(rec[key], str) or not rec[key].strip():
            raise DataError(f"{where}: field '{key}' must be a non-empty string")
    if extract_answer(rec["answer"], "strict") is None:
        raise DataError(f"{where}: answer has no parseable final '#### N'")
    return {"question": rec["question"].strip(), "answer": rec["answer"].strip()}


def _collect(records, on_bad: str, report: LoadReport) -> list[dict]:
    out = []
    for where, rec in records:
        try:
            out.append(check_record(rec, where))
        except DataError as e:
            if on_bad == "error":
                raise
            report.skip(str(e))
    report.kept = len(out)
    return out


def _jsonl_records(path: str, on_bad: str, report: LoadReport):
    """(file:line, record) pairs; a bad line raises, or with on_bad=skip is counted and dropped."""
    for lineno, rec, bad in jsonl_records(path):
        if bad is None:
            yield f"{path}:{lineno}", rec
        elif on_bad == "error":
            raise DataError(bad)
        else:
            report.skip(bad)


def load_jsonl_split(path: str, on_bad: str = "error") -> tuple[list[dict], LoadReport]:
    """Local files in the official GSM8K release format, one {"question","answer"} per line.

    Lines are checked by our own reader first, so that an error names the line; the file then goes
    through `datasets.load_dataset("json")`, the same loader a user's own JSON data set takes.
    """
    if not Path(path).exists():
        raise DataError(f"{path}: file not found")
    report = LoadReport()
    records = _collect(_jsonl_records(path, on_bad, report), on_bad, report)
    if not records:
        why = f"all {report.skipped} records are invalid ({report.reasons[0]})" if report.skipped else "the file holds no records"
        raise DataError(f"{path}: no usable GSM8K records: {why}")
    if report.skipped == 0:
        import datasets

        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        if len(ds) != len(records):
            raise DataError(f"{path}: datasets read {len(ds)} rows but {len(records)} valid records")
        records = [{"question": r["question"].strip(), "answer": r["answer"].strip()} for r in ds]
    return records, report


def load_hub_split(
    hub_id: str, config: str, split: str, on_bad: str = "error"
) -> tuple[list[dict], LoadReport]:
    """A split of a hub data set such as openai/gsm8k (needs network access to the hub)."""
    import datasets

    ds = datasets.load_dataset(hub_id, config, split=split)
    report = LoadReport()
    records = _collect(((f"{hub_id}[{split}][{i}]", dict(r)) for i, r in enumerate(ds)), on_bad, report)
    return records, report


def solution_steps(answer: str) -> int:
    """Reasoning lines of a reference solution: the non-empty lines before the final '#### N'."""
    body = answer.rsplit("####", 1)[0]
    return sum(1 for line in body.splitlines() if line.strip())


def format_prompt(question: str, template: str) -> str:
    return template.format(question=question)


def format_completion(answer: str) -> str:
    """The SFT target that follows the prompt; the tokenizer's EOS is appended by the caller."""
    return " " + answer


def read_split(data_dir: str | Path, name: str) -> list[dict]:
    """The records of `<data_dir>/<name>.jsonl` (train, val or test), an error naming a missing split or
    one whose bytes differ from the manifest's record of them (rloo.data.manifest)."""
    data_dir = Path(data_dir)
    path = data_dir / f"{name}.jsonl"
    if not path.is_file():
        raise MissingInputError(f"{path}: no {name} split; run `rloo prepare` (this data folder predates it)")
    return [row for _, row in read_jsonl(verify_split(data_dir, name))]
