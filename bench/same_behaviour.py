"""The micro PPO chain and the micro comparison on two trees, side by side: the same weights and numbers?

Issue 64 (item 7) moved every module and gave the three training stages one shape, with behaviour
unchanged. This runs the same Snakemake commands in a clean copy of each tree (the baseline: a clone at
`--baseline`; this tree, or `--tree`, as it is), each with its own code (PYTHONPATH = the copy; the rules'
`rloo` command is the copy's CLI module, `rloo.cli` before the move and `rloo_workflow.cli` after it),
one venv for both (as bench/stage_speed.py runs two trees), MLflow off and offline:

    snakemake all results/comparison.json --cores 1 --configfile config/micro.yaml config/same.yaml
    snakemake results/gsm8k_rloo.json results/gsm8k_grpo.json --cores 1 \
        --configfile config/micro.yaml config/same.yaml config/proxy.yaml

config/same.yaml: tracking off and `comparison.estimators: [rloo, grpo, ppo]` (the tests' micro
comparison, tests/e2e/test_workflow.py): prepare, base, SFT, the reward model, RLOO, GRPO and PPO with its
critic, each policy's evaluation, the reports, the toy experiment and the comparison. config/proxy.yaml
(PROXY) then trains RLOO and GRPO again on the reward model's score, since under the verifier the micro
policy earns no reward and their weights stay SFT's.

Then it compares, artifact by artifact (the proxy run's rows prefixed `proxy reward:`):
- every model's weights: each `*.safetensors` under results/models, a SHA-256 of its tensors (name,
  dtype, shape and bytes, in name order);
- every JSON and JSON-lines file under data/ and results/ (prepare's data and manifest, each stage's
  metrics.json and steps, the reports, the toy experiment, the comparison), after dropping the keys that
  measure the machine rather than the run (DROPPED: seconds, rates per second, memory peaks; the figure
  file lists the keys dropped) and writing the copy's folder as `<tree>`. A string that names a file may
  differ, and is listed as such (modules moved). Every number and every other string must be equal;
- each policy's evaluation: its texts per problem (`records:<policy>`) and its figures
  (`figures:<policy>`), read from either layout (MOVED: issue 63 moved them to results/eval/).
KNOWN lists the differences other issues made between b5444b5 and issue 64 on purpose, each by key; they
are shown, and do not fail the run.

It prints a table (artifact, baseline, this tree, equal?), writes `--json` through bench/record.py's
`write`, and exits 1 naming every artifact that differs. About 6 minutes on 2 cores.

    python bench/same_behaviour.py --baseline b5444b5 --json docs/figures/same_behaviour.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write  # noqa: E402

# What a tree's run needs (the tests' working copy, tests/helpers/workflow_helpers.py make_copy): no
# data/ or results/ of the checkout, so that every output is made here.
TREE_PARTS = ("Snakefile", "workflow", "config", "slurm", "profiles", "rloo", "rloo_workflow")
ESTIMATORS = ("rloo", "grpo", "ppo")
SAME_CONFIG = ("tracking: {enabled: false}\n"
               f"comparison: {{estimators: [{', '.join(ESTIMATORS)}]}}\n")
TARGETS = ("all", "results/comparison.json")
# The micro policy solves nothing, so under the verifier every RLOO and GRPO advantage is 0 and their
# weights stay SFT's: a second run trains both on the reward model's score (reward.source: model, an
# RLOO key: only their rloo, evaluate and report jobs rerun), so that their update is compared too.
PROXY = ("config/proxy.yaml", "reward: {source: model}\n")
PROXY_TARGETS = ("results/gsm8k_rloo.json", "results/gsm8k_grpo.json")
PROXY_ROWS = re.compile(r"rloo_(rloo|grpo)/|gsm8k_(rloo|grpo)\.json|^(records|figures):(rloo|grpo)$")

# Keys whose values measure the machine or the moment, not the run: wall-clock seconds, rates per
# second and a process's memory high-water mark. The keys a run dropped are listed in its figure file.
DROPPED = re.compile(r"seconds|per_second|peak_memory|elapsed|wall_|timings?$")
# A string naming a file: may differ between trees when a module moved.
PATHLIKE = re.compile(r"(^|/)[\w.<>-]+/[\w./<>-]+|\.py\b")
# Differences that other issues made between b5444b5 and issue 64 on purpose, each checked where it shows
# (artifact pattern, key pattern, why). prepare's data files are compared byte for byte, so the manifest's
# hash and config hash may differ only by the manifest's new key and the data section's new keys.
KNOWN = (
    (r"", r"(^|\.)train_test_ngram_overlap\.", "added by issue 61 item 3 (5f4f108): the 13-gram overlap count"),
    (r"", r"(^|\.)data_manifest_sha256(\.|$)", "the manifest gained train_test_ngram_overlap (issue 61 item 3)"),
    (r"^data/gsm8k/manifest\.json$", r"^config_hash$", "the data section gained four keys (issue 61 items 3, 4: max_record_chars, "
     "on_oversized, ngram_overlap_words, on_ngram_overlap)"),
)
# What issue 63 (cf30855) moved: the evaluations' records and figures, once per policy in results/eval/
# instead of per estimator in results/gsm8k_<estimator>/completions.jsonl and results/gsm8k_<estimator>.json.
# Both layouts are read into `records:<policy>` and `figures:<policy>` rows; the files themselves are not
# compared by name.
MOVED = re.compile(r"^results/eval/[^/]+\.jsonl?$|^results/gsm8k_[^/]+/completions\.jsonl$")


def _cli_module(tree: Path) -> str:
    return "rloo_workflow.cli" if (tree / "rloo_workflow" / "cli.py").is_file() else "rloo.cli"


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake")
    for name in TREE_PARTS:
        p = src / name
        if p.is_dir():
            shutil.copytree(p, dest / name, ignore=ignore)
        elif p.is_file():
            shutil.copy2(p, dest / name)
    (dest / "config" / "same.yaml").write_text(SAME_CONFIG)
    (dest / PROXY[0]).write_text(PROXY[1])
    # The rules call `rloo <verb>`: here, this tree's own CLI module under this venv's Python.
    shim = dest / ".bin"
    shim.mkdir()
    (shim / "rloo").write_text(f"#!/bin/sh\nexec {sys.executable} -m {_cli_module(dest)} \"$@\"\n")
    (shim / "rloo").chmod(0o755)
    return dest


def _run_tree(tree: Path, log: Path, targets: tuple[str, ...], configfiles: tuple[str, ...]) -> float:
    """`snakemake TARGETS` in `tree` with its own code, on config/micro.yaml, config/same.yaml and
    `configfiles`; the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PATH": f"{tree / '.bin'}{os.pathsep}{Path(sys.executable).parent}"
           f"{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": (tree / "mlruns").as_uri(), "PYTHONDONTWRITEBYTECODE": "1"}
    for var in ("MLFLOW_RUN_ID", "VIRTUAL_ENV"):
        env.pop(var, None)
    # Targets first: --configfile takes several values.
    cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", "1", "--configfile", "config/micro.yaml",
           "config/same.yaml", *configfiles]
    t0 = time.time()
    with log.open("a") as f:
        res = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{tree}: {' '.join(cmd)} exited {res.returncode} (log {log}):\n{tail}")
    return time.time() - t0


def _weights(path: Path) -> str:
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _normalise(value: Any, tree: str, dropped: set[str]) -> Any:
    """`value` without the DROPPED keys (added to `dropped`), the tree's folder written `<tree>`."""
    if isinstance(value, dict):
        dropped.update(str(k) for k in value if DROPPED.search(str(k)))
        return {k: _normalise(v, tree, dropped) for k, v in value.items() if not DROPPED.search(str(k))}
    if isinstance(value, list):
        return [_normalise(v, tree, dropped) for v in value]
    return value.replace(tree, "<tree>") if isinstance(value, str) else value


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf (lists indexed `[i]`)."""
    if isinstance(value, dict):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(value)]
    else:
        return {prefix: value}
    return {k: v for key, item in items for k, v in _leaves(item, key).items()}


def _read(path: Path) -> Any:
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else json.loads(text)


def _outputs(tree: Path) -> dict[str, Path]:
    """The run's data, models and results files by relative path (not its checkpoints, timings and run ids)."""
    # identity.json: the record of the job that made a folder (rloo.identity, issue 70), provenance like the run ids
    found = [p for d in ("data", "results") for p in (tree / d).rglob("*")
             if p.is_file() and p.suffix in (".json", ".jsonl", ".safetensors") and p.name != "identity.json"]
    names = {p.relative_to(tree).as_posix(): p for p in found}
    return {k: p for k, p in sorted(names.items()) if not k.startswith(("results/work/", "results/runs/"))}


def _records(tree: Path) -> dict[str, list[dict]]:
    """Each policy's evaluation texts, per problem: question, answer, greedy completion and sampled draws,
    from either layout (MOVED). A policy found in several files must read the same in each."""
    per_policy: dict[str, list[list[dict]]] = {}
    for path in sorted((tree / "results" / "eval").glob("*.jsonl")):
        rows = [{"question": r["question"], "answer": r["answer"], "greedy": r["greedy"]["text"],
                 "draws": [d["text"] for d in r["draws"]]} for r in _read(path)]
        per_policy.setdefault(path.stem, []).append(rows)
    for path in sorted((tree / "results").glob("gsm8k_*/completions.jsonl")):
        rows = _read(path)
        for policy in rows[0]["completions"] if rows else ():
            per_policy.setdefault(policy, []).append([
                {"question": r["question"], "answer": r["answer"], "greedy": r["completions"][policy]["greedy"],
                 "draws": r["completions"][policy]["draws"]} for r in rows])
    return {p: v[0] if all(x == v[0] for x in v) else {"inconsistent between files": v} for p, v in per_policy.items()}


def _figures(tree: Path) -> dict[str, dict]:
    """Each policy's evaluation figures: results/eval/<policy>.json, or (before issue 63) the estimators'
    results JSONs (`policies` and `base`)."""
    found: dict[str, dict] = {}
    for path in sorted((tree / "results").glob("gsm8k_*.json")):
        result = _read(path)
        found.update({p: dict(f) for p, f in result.get("policies", {}).items()})
        if "policy" in result.get("base", {}):
            found["base"] = dict(result["base"]["policy"])
    for path in sorted((tree / "results" / "eval").glob("*.json")):
        found[path.stem] = dict(_read(path)["figures"])
    return found


def _known(name: str, key: str) -> str | None:
    return next((why for art, k, why in KNOWN if re.search(art, name) and re.search(k, key)), None)


def _diff(name: str, docs: tuple[Any, Any]) -> dict[str, Any]:
    """Two JSON documents, leaf by leaf: what differs (a number, or text that names no file), what
    differs only as a path, and what differs as KNOWN."""
    la, lb = _leaves(docs[0]), _leaves(docs[1])
    differs, paths, known = [], [], []
    for k in sorted(set(la) | set(lb)):
        va, vb = la.get(k, "<missing>"), lb.get(k, "<missing>")
        if va == vb:
            continue
        row = {"key": k, "baseline": va, "this_tree": vb}
        if _known(name, k):
            known.append({**row, "why": _known(name, k)})
        elif all(isinstance(v, str) and PATHLIKE.search(v) for v in (va, vb)):
            paths.append(row)
        else:
            differs.append(row)
    digest = [hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12] for d in (la, lb)]
    return {"baseline": digest[0], "this_tree": digest[1], "equal": not differs, "differs": differs[:20],
            "differs_count": len(differs), "paths_differ": paths[:20], "known": known}


def _table(trees: tuple[Path, Path], dropped: set[str]) -> dict[str, dict]:
    """Every artifact of both runs: weights by tensor hash, JSON after _normalise, the moved records and
    figures by policy; a file that only one tree wrote (and MOVED does not explain) differs."""
    outs = [_outputs(t) for t in trees]
    table: dict[str, dict] = {}
    for name in sorted(set(outs[0]) | set(outs[1])):
        if MOVED.search(name):
            continue
        if name not in outs[0] or name not in outs[1]:
            table[name] = {"baseline": "yes" if name in outs[0] else "absent", "equal": False,
                           "this_tree": "yes" if name in outs[1] else "absent", "differs": []}
        elif name.endswith(".safetensors"):
            da, db = (_weights(o[name]) for o in outs)
            table[name] = {"baseline": da[:12], "this_tree": db[:12], "equal": da == db, "differs": []}
        else:
            table[name] = _diff(name, tuple(_normalise(_read(o[name]), str(t), dropped) for o, t in zip(outs, trees, strict=True)))
    for kind, read in (("records", _records), ("figures", _figures)):
        both = [read(t) for t in trees]
        for policy in sorted(set(both[0]) | set(both[1])):
            docs = tuple(b.get(policy, {}) for b in both)
            if kind == "figures":  # the figures the newer layout keeps per policy (pass@k etc. moved to the report)
                keys = set(docs[0]) & set(docs[1])
                docs = tuple({k: v for k, v in d.items() if k in keys} for d in docs)
            table[f"{kind}:{policy}"] = _diff(f"{kind}:{policy}", tuple(_normalise(d, "", dropped) for d in docs))
    return table


def _print(table: dict[str, dict], dropped: set[str]) -> list[str]:
    width = max(map(len, table))
    print(f"\n{'artifact':{width}s}  {'baseline':12s}  {'this tree':12s}  equal?")
    for name, row in table.items():
        mark = ("yes" if not row.get("known") else "yes, but known") if row["equal"] else "NO"
        print(f"{name:{width}s}  {row['baseline']:12s}  {row['this_tree']:12s}  {mark}")
        for d in row["differs"][:5]:
            print(f"    {d['key']}: {d['baseline']!r} != {d['this_tree']!r}")
    known = sorted({d["why"] for row in table.values() for d in row.get("known", [])})
    unequal = [n for n, r in table.items() if not r["equal"]]
    print("\nknown differences:" + "".join(f"\n  {k}" for k in known))
    print(f"dropped keys (the machine, not the run): {', '.join(sorted(dropped))}")
    print(f"{len(table) - len(unequal)} of {len(table)} artifacts equal" + (f"; differ: {', '.join(unequal)}" if unequal else ""))
    return unequal


def _clone(rev: str, dest: Path) -> str:
    """A clean clone of this repository at `rev`; returns its commit."""
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", rev], check=True)
    return subprocess.run(["git", "-C", str(dest), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="b5444b5", help="the git revision to compare with (cloned, checked out)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout to compare with it (default: this one, as it is)")
    ap.add_argument("--json", default=None, help="write the table here (bench/record.py)")
    ap.add_argument("--keep", action="store_true", help="keep the two runs' folders (printed) to look into")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rloo-same-behaviour-"))
    t0 = time.time()
    try:
        commit = _clone(a.baseline, work / "clone")
        trees = (_copy(work / "clone", work / "baseline"), _copy(Path(a.tree).resolve(), work / "this"))
        seconds = {}
        for label, tree in zip(("baseline", "this tree"), trees, strict=True):
            print(f"{label}: {_cli_module(tree)} in {tree} ...", flush=True)
            seconds[label] = _run_tree(tree, work / f"{tree.name}.log", TARGETS, ())
        dropped: set[str] = set()
        table = _table(trees, dropped)
        for label, tree in zip(("baseline", "this tree"), trees, strict=True):
            print(f"{label}: RLOO and GRPO on the proxy reward ...", flush=True)
            seconds[label] = round(seconds[label] + _run_tree(tree, work / f"{tree.name}.log", PROXY_TARGETS,
                                                              (PROXY[0],)), 1)
        table.update({f"proxy reward: {k}": v for k, v in _table(trees, dropped).items() if PROXY_ROWS.search(k)})
    finally:
        if a.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    unequal = _print(table, dropped)
    if a.json:
        write(a.json, {
            "baseline": a.baseline, "baseline_commit": commit,
            "runs": [f"snakemake {' '.join(TARGETS)} --cores 1 --configfile config/micro.yaml config/same.yaml",
                     f"snakemake {' '.join(PROXY_TARGETS)} --cores 1 --configfile config/micro.yaml config/same.yaml "
                     f"{PROXY[0]}"],
            "same_yaml": SAME_CONFIG, "proxy_yaml": PROXY[1], "dropped_keys": sorted(dropped), "run_seconds": seconds,
            "wall_seconds": round(time.time() - t0, 1), "unequal": unequal, "artifacts": table})
    if unequal:
        raise SystemExit(f"differ between {a.baseline} and this tree: {', '.join(unequal)}")


if __name__ == "__main__":
    main()
