"""Every figure in README.md, BENCHMARKS.md and docs/*.md comes from a committed results file
(docs/figures/*.json), and each file says how and at which commit it was made:

- each table between `<!-- figures:NAME -->` markers is rendered from its files by scripts/figures.py:
  a table edited by hand, or a file changed without re-rendering, fails here;
- each file records its `command` and `commit` (bench/record.py writes them; never by hand);
- no measured-looking number stands in prose without a file: outside the rendered tables, its
  paragraph names its file (`<!-- figure: docs/figures/x.json -->` or a link to it), or says it is
  quoted from an outside source (`<!-- quoted: ... -->`) or a setting, not a measurement
  (`<!-- setting: ... -->`); scripts/figures.py (the block above `unbacked_numbers`) says what counts.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"


def _figures_module():
    spec = importlib.util.spec_from_file_location("figures_script", ROOT / "scripts" / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


figures = _figures_module()

# Files made before their scripts recorded a commit. The commit they ran on cannot be recovered, so
# they are to be regenerated (the command is each file's `command`; docs/testing.md lists them with
# what they back); each is an expected failure until it is, and a strict one: a regenerated file
# passes, and its entry must then go. Add nothing here: a new file is written by bench/record.py.
AWAITING_REGENERATION: set[str] = set()
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def provenance_problems(record: dict) -> list[str]:
    problems = []
    if not isinstance(record.get("command"), str) or not record["command"].strip():
        problems.append("no command")
    if not isinstance(record.get("commit"), str) or not _COMMIT.fullmatch(record["commit"]):
        problems.append(f"no commit (a 7- to 40-digit hex id), found {record.get('commit')!r}")
    return problems


def test_tables_match_their_result_files():
    stale = [str(p.relative_to(ROOT)) for p in figures.PAGES if figures.render(p.read_text(), p) != p.read_text()]
    assert not stale, f"run `python scripts/figures.py`: tables out of date in {stale}"


def test_every_table_names_a_file_that_exists():
    for page in ("README.md", "BENCHMARKS.md", "docs/tuning.md", "docs/results.md"):
        text = (ROOT / page).read_text()
        blocks = re.findall(r"<!-- figures:([\w-]+) -->", text)
        assert blocks, page
        for link in re.findall(r"\]\(((?:docs/)?figures/[\w.-]+)\)", text):
            assert ((ROOT / page).parent / link).is_file(), (page, link)


def test_a_table_links_its_files_from_the_page_it_is_in():
    """A block moves between pages as it is: README.md links docs/figures/x.json, a page in docs/ figures/x.json."""
    block = "<!-- figures:pipeline -->\n<!-- /figures:pipeline -->"
    front, inner = figures.render(block, Path("README.md")), figures.render(block, ROOT / "docs" / "results.md")
    assert "](docs/figures/pipeline_seed0.json)" in front
    assert "](figures/pipeline_seed0.json)" in inner and "](docs/figures/" not in inner


def test_no_link_leads_nowhere():
    problems = [p for page in figures.PAGES for p in figures.broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_link_check_refuses_a_link_from_the_wrong_folder_and_a_missing_anchor():
    page = Path("docs/probe.md")
    ok = ("# Top\n\n[a](figures/seeds.json) [b](../README.md#results) [c](#top) [d](https://example.org/x) "
          "`[e](nowhere.md)`\n\n```\n[f](nowhere.md)\n```\n")
    assert figures.broken_links(page, ok) == []
    for bad in ("[a](docs/figures/seeds.json)", "[b](../README.md#no-such-heading)", "[c](#gone)", "[d](results.md#top)"):
        assert figures.broken_links(page, f"# Top\n\n{bad}\n"), bad


@pytest.mark.parametrize("name", sorted(f.name for f in FIGURES.glob("*.json")))
def test_each_figure_file_records_its_command_and_commit(name):
    if name in AWAITING_REGENERATION:
        pytest.xfail(f"{name}: made before its script recorded a commit; to be regenerated")
    assert not provenance_problems(json.loads((FIGURES / name).read_text())), name


def test_the_regeneration_list_names_only_files_that_need_it():
    for name in AWAITING_REGENERATION:
        path = FIGURES / name
        assert path.is_file(), f"{name} is gone: drop it from AWAITING_REGENERATION"
        assert provenance_problems(json.loads(path.read_text())), f"{name} has its commit: drop it from the list"


def test_a_file_without_a_commit_is_refused():
    good = {"command": "python bench/x.py --json out.json", "commit": "4568c225715ca5836a31ba222eefb015a5d39132"}
    assert not provenance_problems(good)
    assert not provenance_problems({**good, "commit": "4568c22"})
    for bad in ({**good, "commit": None}, {"command": good["command"]}, {**good, "commit": "HEAD"},
                {**good, "commit": "944aa76 (a fresh clone)"}, {**good, "command": ""}):
        assert provenance_problems(bad), bad


def test_no_measured_number_in_prose_without_a_file():
    problems = [p for page in figures.PAGES for p in figures.unbacked_numbers(page)]
    assert not problems, "\n".join(problems)


def _check(text):
    return figures.unbacked_numbers(Path("probe.md"), text)


def test_the_prose_check_refuses_an_unmarked_measurement():
    for measured in ("A step takes 0.9 s here.", "It is 1.7× faster.", "The peak grew 8 % with 16x the rows.",
                     "Held-out accuracy 0.605 on 172 pairs.", "It fits in 67 GB.", "McNemar gives p = 0.058.",
                     "The suite passed in 94 s.", "## A 2.4x faster step"):
        assert _check(f"Some prose.\n\n{measured}\n"), measured


def test_the_prose_check_accepts_marked_figures_settings_and_code():
    ok = """Settings are not measurements: k = 4 samples, 16 prompts, 480 steps, issue 37, line 146, 2026-12-02,
T = 1, lr 3e-6, β 0.05, a 95 % interval, Python ≥ 3.11, a 0.5B and a 7B policy, 1 node x 8 GPUs.

Code is not prose: `rloo.rollout.gpu_memory_utilization: 0.3`, commit 944aa76.

```
python bench/x.py --scale 1.5
```

A step takes 0.9 s, 1.7× faster. <!-- figure: docs/figures/rloo_step.json -->

The same, linked: 0.9 s ([rloo_step](figures/rloo_step.json)).

Its 7B example: 252 / 140 = 1.80×. <!-- quoted: the method description -->

Within ±20 % of the plan. <!-- setting: tests/e2e/test_memory_plan.py's tolerance -->

- an item with 3.2× <!-- figure: docs/figures/dynamic_sampling_on.json -->
- an item with no number

<!-- figures:pipeline -->
| a rendered table | 0.776 |
<!-- /figures:pipeline -->
"""
    assert _check(ok) == []


def test_a_marker_covers_its_paragraph_or_list_item_only():
    got = _check("- 3.2× backed <!-- figure: docs/figures/dynamic_sampling_on.json -->\n- 1.8× not\n\n"
                           "0.9 s backed. <!-- figure: docs/figures/rloo_step.json -->\n\n0.8 s not.\n")
    assert len(got) == 2 and "1.8×" in got[0] and "0.8 s" in got[1], got


def test_a_marker_must_name_a_file_or_a_source():
    assert _check("0.9 s <!-- figure: docs/figures/no_such.json -->\n")
    assert _check("0.9 s <!-- quoted: -->\n")
    assert _check("0.9 s, as `<!-- figure: docs/figures/rloo_step.json -->` marks it\n")  # quoted in code


def test_figures_check_runs_both_checks():
    res = subprocess.run([sys.executable, "scripts/figures.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_collect_stamps_the_checkout_the_run_ran_in(tmp_path):
    run = tmp_path / "clone"
    (run / "results").mkdir(parents=True)
    (run / "results" / "gsm8k_rloo.json").write_text(json.dumps({"policies": {}}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(run)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    figures.collect(run, tmp_path / "out.json", "bash scripts/pipeline.sh")
    record = json.loads((tmp_path / "out.json").read_text())
    assert record["commit"] == head and record["command"] == "bash scripts/pipeline.sh", record
    assert record["rloo_clean"] is True and record["machine"] and record["versions"]["python"]
    assert not provenance_problems(record)
    (run / "rloo").mkdir()
    (run / "rloo" / "edited.py").write_text("")  # an untracked package file: not the commit's code
    figures.collect(run, tmp_path / "out.json", "bash scripts/pipeline.sh")
    assert json.loads((tmp_path / "out.json").read_text())["rloo_clean"] is False
    plain = tmp_path / "not-a-checkout"
    (plain / "results").mkdir(parents=True)
    (plain / "results" / "gsm8k_rloo.json").write_text("{}")
    figures.collect(plain, tmp_path / "out.json", "bash scripts/pipeline.sh")
    assert provenance_problems(json.loads((tmp_path / "out.json").read_text()))  # no commit: refused


def test_a_pipeline_figure_runs_the_default_config_and_the_overlays_its_command_names():
    figures = _figures_module()
    paths = figures.code_paths({"command": "snakemake --cores all results/comparison.json --configfile "
                                           "config/comparison.yaml   # after bash scripts/pipeline.sh"})
    assert {"config/config.yaml", "config/comparison.yaml", "workflow", "rloo_workflow/stages/rloo.py"} <= set(paths)
    assert not any(p == "config" or p.startswith("config/smollm2") for p in paths)  # another overlay: not run
    # the file an overlay extends is read beneath it (smollm2-judge.yaml -> smollm2.yaml -> config.yaml)
    bench = figures.code_paths({"command": "python bench/rollout_backends.py -c config/smollm2-judge.yaml"})
    assert {"bench/rollout_backends.py", "config/smollm2-judge.yaml", "config/smollm2.yaml", "config/config.yaml"} <= set(bench)
    assert "config/config.yaml" in figures.code_paths({"command": "python bench/rloo_step.py --rounds 3"})  # its default


def test_stale_counts_a_change_of_meaning_not_of_comments():
    """`figures.py stale` skips a commit that only edits comments or docstrings (a config's note, a code
    comment): the same comparison as the stages' code fingerprints (rloo_workflow.code_fingerprint.same_meaning)."""
    from rloo.code_fingerprint import same_meaning

    yml = "sft:\n  steps: 60   # enough\n"
    assert same_meaning("config/x.yaml", yml, "# a note\nsft:\n  steps: 60   # more than enough\n")
    assert not same_meaning("config/x.yaml", yml, "sft:\n  steps: 61\n")
    py = "def f(x):\n    return x + 1  # why\n"
    assert same_meaning("rloo/x.py", py, "# header\ndef f(x):\n    return x + 1\n")
    assert same_meaning("rloo/x.py", py, '"""A module."""\ndef f(x):\n    """Adds one."""\n    return x + 1\n')
    assert not same_meaning("rloo/x.py", py, "def f(x):\n    return x + 2\n")
    assert not same_meaning("rloo/x.py", "", py)  # a file added
    assert not same_meaning("Snakefile", "rule a:\n", "rule a:  # note\n")  # other files: any change
