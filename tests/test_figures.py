"""Every table of README.md, BENCHMARKS.md and docs/*.md is rendered from a committed results file
(docs/figures/*.json, by scripts/figures.py): a table edited by hand, or a file changed without
re-rendering, fails here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tables_match_their_result_files():
    res = subprocess.run([sys.executable, "scripts/figures.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_every_table_names_a_file_that_exists():
    import re

    for page in ("README.md", "BENCHMARKS.md", "docs/tuning.md"):
        text = (ROOT / page).read_text()
        blocks = re.findall(r"<!-- figures:([\w-]+) -->", text)
        assert blocks, page
        for link in re.findall(r"\]\(((?:docs/)?figures/[\w.-]+)\)", text):
            assert ((ROOT / page).parent / link).is_file(), (page, link)
    for f in (ROOT / "docs" / "figures").glob("*.json"):  # each file says how it was made
        assert json.loads(f.read_text()).get("command"), f
