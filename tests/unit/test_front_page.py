"""README.md's "your model, your data, your reward" overlays are the files in config/examples/: each YAML
block of that section holds the values of the file linked before it, key for key (a block may leave keys
out, never change one), and the section runs each of the three files. The files validate in
tests/unit/test_config.py; the reward overlay runs at micro size in tests/e2e/test_reward_plugins.py.
And no snakemake command in the README, the docs, the overlays' comments or the scripts writes a target
after --configfile's files, where Snakemake would read it as a config file."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Your model, your data, your reward"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def blocks_and_files(text: str) -> list[tuple[dict, str]]:
    """Each YAML block with the config/examples/ file most recently linked before it."""
    out, linked = [], None
    for m in re.finditer(r"\]\((config/examples/[\w.-]+\.yaml)\)|^```yaml\n(.*?)^```", text, re.M | re.S):
        if m.group(1):
            linked = m.group(1)
        else:
            assert linked, "a YAML block before any link to its config/examples/ file"
            out.append((yaml.safe_load(m.group(2)), linked))
    return out


def departures(shown: object, actual: object, where: str = "") -> list[str]:
    """Where the README's block `shown` differs from the file's `actual` (keys the block leaves out aside)."""
    if isinstance(shown, dict) and isinstance(actual, dict):
        return [d for k, v in shown.items()
                for d in (departures(v, actual[k], f"{where}.{k}") if k in actual else [f"{where}.{k}: not in the file"])]
    return [] if shown == actual else [f"{where}: README {shown!r}, file {actual!r}"]


def test_each_overlay_on_the_front_page_is_its_file():
    pairs = blocks_and_files(section())
    assert {f for _, f in pairs} == {f"config/examples/your-{x}.yaml" for x in ("model", "data", "reward")}, pairs
    for shown, path in pairs:
        actual = yaml.safe_load((ROOT / path).read_text())
        assert not departures(shown, actual), (path, departures(shown, actual))


def test_the_front_page_runs_each_overlay():
    text = section()
    for name in ("your-model", "your-data", "your-reward"):
        assert re.search(rf"snakemake --cores \w+ (--configfile [\w/.-]+ )*--configfile( \S+)* config/examples/{name}\.yaml",
                         text), name


def test_a_changed_value_is_a_departure():
    actual = {"reward": {"functions": [{"name": "format", "weight": 0.2}]}, "base": "../config.yaml"}
    assert departures({"reward": {"functions": [{"name": "format", "weight": 0.2}]}}, actual) == []
    assert departures({"reward": {"functions": [{"name": "format", "weight": 0.3}]}}, actual)
    assert departures({"reward": {"source": "function"}}, actual) == [".reward.source: not in the file"]


# -- no documented command lets --configfile swallow a target (issue 62) ------------------------------------
# Snakemake reads every word after --configfile up to the next option as a config file, so a target written
# after the files is read as one (`IsADirectoryError: ... 'results/models/rloo_rloo'`). Every command the
# docs, the overlays' comments and the scripts' usage show puts its targets first or --configfile last.
MARKDOWN = ("README.md", "BENCHMARKS.md", "docs/*.md")
COMMENTED = ("config/**/*.yaml", "profiles/**/*.yaml", "scripts/*", "Snakefile", "workflow/**/*.smk")
# `snakemake` (any path to it); scripts/pipeline.sh, whose arguments go to snakemake after `--cores all`; and
# rloo's tools that take --configfile as snakemake does (argparse's nargs="+" swallows the same way)
_COMMANDS = r"(?:\S*/)?(?:snakemake|scripts/pipeline\.sh)|rloo (?:why-rerun|dvc \w+)"
COMMAND = re.compile(rf"(?:^|(?<=[\s(`=]))(?:{_COMMANDS})(?=\s|$)")
COMMAND_LINE = re.compile(rf"^(?:\w+=\S+\s+)*(?:bash\s+)?(?:{_COMMANDS})(?=\s|$)")
END = re.compile(r"`|\s#|;|&&|\|")  # where a command's words end: its code span, a comment, the next command
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def swallowed(command: str) -> list[str]:
    """The words of a snakemake command that Snakemake would read as config files though they are not: those
    among --configfile's files that are not .yaml/.yml files (a target, a rule)."""
    out, files = [], False
    for word in command.split():
        if word.startswith("-"):
            files = word in ("--configfile", "--configfiles")
        elif files and not word.endswith((".yaml", ".yml")) and word not in ("...", "\\"):
            out.append(word)
    return out


def _logical_lines(text: str, first: int = 1) -> list[tuple[int, str]]:
    """(line number, line) with each `\\`-continued line joined to the next (a comment's `#` dropped)."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines(), start=first):
        if pending is not None:
            n, line = pending[0], pending[1] + " " + line.lstrip().lstrip("#").strip()
        pending = (n, line.rstrip()[:-1]) if line.rstrip().endswith("\\") else None
        if pending is None:
            out.append((n, line))
    return out + ([pending] if pending else [])


def command_spans(text: str, markdown: bool) -> list[tuple[int, str]]:
    """(line number, text that may hold a command): a markdown file's fenced lines and inline code (a span
    may wrap onto the next line); in any other file, lines that begin with a command (after a comment's
    `#`) and inline code in comments and docstrings."""
    out: list[tuple[int, str]] = []
    if markdown:
        for block in FENCE.finditer(text):
            out += _logical_lines(block.group(1), text.count("\n", 0, block.start(1)) + 1)
        # the fences blanked (line numbers kept) before the inline spans are read
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    else:
        out += [(n, s) for n, line in _logical_lines(text)
                if COMMAND_LINE.match(s := line.strip().lstrip("#").strip())]
    for m in INLINE.finditer(text):
        if "\n\n" not in m.group(1):
            out.append((text.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return out


def swallowing_commands(root: Path = ROOT) -> list[str]:
    """`file:line: command` for each documented snakemake command in which --configfile swallows a word."""
    found = []
    for patterns, markdown in ((MARKDOWN, True), (COMMENTED, False)):
        for path in sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()}):
            for n, span in command_spans(path.read_text(), markdown):
                for m in COMMAND.finditer(span):
                    command = END.split(span[m.end():], 1)[0]
                    if swallowed(command):
                        found.append(f"{path.relative_to(root)}:{n}: {' '.join((m.group(0) + command).split())}")
    return found


def test_no_documented_command_lets_configfile_swallow_a_target():
    found = swallowing_commands()
    assert not found, "put the target first (or --configfile last):\n" + "\n".join(found)


def test_the_scan_finds_a_target_after_the_configfiles(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "config").mkdir()
    (tmp_path / "README.md").write_text("Run `snakemake --cores 1 results/x.json --configfile a.yaml b.yaml`.\n\n"
                                        "Or `bash scripts/pipeline.sh --configfile a.yaml\nresults/x.json`.\n")
    (tmp_path / "docs" / "d.md").write_text("# d\n\n```bash\nsnakemake --cores all --configfile a.yaml \\\n"
                                            "  b.yaml results/x.json   # b's target\nsnakemake -n all\n```\n")
    (tmp_path / "config" / "c.yaml").write_text("# Run:\n#   snakemake --configfile config/c.yaml all\n"
                                                "# (snakemake --configfile always reads it)\n"
                                                "#   rloo why-rerun --configfile config/c.yaml sft\nseed: 0\n")
    assert swallowing_commands(tmp_path) == [
        "README.md:3: scripts/pipeline.sh --configfile a.yaml results/x.json",
        "docs/d.md:4: snakemake --cores all --configfile a.yaml b.yaml results/x.json",
        "config/c.yaml:2: snakemake --configfile config/c.yaml all",
        "config/c.yaml:4: rloo why-rerun --configfile config/c.yaml sft",
    ]
