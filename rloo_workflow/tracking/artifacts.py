"""Which files of a stage's outputs MLflow gets, and the scrubbed text it gets instead of the file.

Metrics JSON, step logs and plots are small and worth browsing; weights, tokenizer files and data
splits are large and already versioned by DVC, so only their md5 goes into the tags.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from rloo_workflow.tracking.redact import redact, redact_text

# Files of a stage's output folders that become artifacts (besides every *.png).
ARTIFACT_NAMES = {"metrics.json", "history.json", "steps.jsonl", "manifest.json"}
ARTIFACT_SUFFIXES = {".json", ".jsonl", ".png", ".txt", ".md", ".csv", ".tsv", ".yaml", ".yml"}
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}
MAX_ARTIFACT_BYTES = 20 << 20
MAX_LOG_BYTES = 5 << 20
TEXT_SUFFIXES = {".json", ".jsonl", ".txt", ".md", ".csv", ".tsv", ".yaml", ".yml", ".log"}


def artifact_files(out: Path) -> list[Path]:
    """The files of output `out` (a file or a folder) that are logged as artifacts."""
    if out.is_file():
        return [out] if out.suffix.lower() in ARTIFACT_SUFFIXES else []
    files = []
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name in ARTIFACT_NAMES or p.suffix.lower() == ".png":
            files.append(p)
    return files


def redacted_file_text(path: Path) -> str:
    """A text file's content with its secrets replaced (JSON kept valid); a long log keeps its end."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".log" and len(text) > MAX_LOG_BYTES:
        text = f"[... {len(text) - MAX_LOG_BYTES} characters cut ...]\n" + text[-MAX_LOG_BYTES:]
    if path.suffix.lower() == ".json":
        with contextlib.suppress(json.JSONDecodeError):
            return json.dumps(redact(json.loads(text)), indent=2) + "\n"
    if path.suffix.lower() == ".jsonl":
        lines = []
        for line in text.splitlines():
            try:
                lines.append(json.dumps(redact(json.loads(line))) if line.strip() else line)
            except json.JSONDecodeError:
                lines.append(redact_text(line))
        return "\n".join(lines) + "\n"
    return redact_text(text)
