"""The data folder as `rloo prepare` left it: every split a stage reads is checked against the SHA-256
that manifest.json (written last) records for it.

A prepare killed between renaming a split into place and writing the manifest leaves a new split beside
the old manifest (or, on a first run, no manifest at all); a split edited by hand is the same case. A
stage would train or evaluate on data its manifest does not describe, and the results would hash that
stale manifest, so it stops instead, with one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from rloo.errors import InputError, MissingInputError
from rloo.io import sha256_file

MANIFEST = "manifest.json"


def read_manifest(data_dir: str | Path) -> dict:
    """The folder's manifest.json; an error naming it when it is missing or unreadable."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise MissingInputError(f"{path} does not exist: `rloo prepare` did not finish writing {data_dir} "
                                "(rerun it, or snakemake runs it)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a readable manifest ({e}); rerun `rloo prepare`") from None


def verify_split(data_dir: str | Path, name: str) -> Path:
    """`<data_dir>/<name>.jsonl`, once its SHA-256 matches the manifest's record of it (a manifest that
    records none, from before the digests, is taken as it is)."""
    path = Path(data_dir) / f"{name}.jsonl"
    want = (read_manifest(data_dir).get("sha256") or {}).get(name)
    if want is not None and path.is_file() and sha256_file(path) != want:
        raise InputError(f"{path}: its SHA-256 differs from the one {Path(data_dir) / MANIFEST} records (an "
                         "interrupted `rloo prepare`, or a file changed since): rerun `rloo prepare`")
    return path
