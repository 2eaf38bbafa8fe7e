"""The `seeds` target's table: one row per seed from that seed's results file, and the mean of every
figure across seeds with a t-interval (rloo.eval.stats.t_interval). Nothing here is measured: every number
is read from, or computed from, the per-seed results files."""

from __future__ import annotations

from typing import Any

from rloo.errors import InputError
from rloo.eval.stats import LEVEL, t_interval

# A row's figures: (name in the row, path in the results file; `{policy}` is the trained policy).
FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sft_sampled", ("policies", "sft", "accuracy_sampled")),
    ("sft_greedy", ("policies", "sft", "accuracy")),
    ("rloo_sampled", ("policies", "{policy}", "accuracy_sampled")),
    ("rloo_greedy", ("policies", "{policy}", "accuracy")),
    ("gain_sampled", ("gains", "{policy}", "sampled", "gain")),
    ("gain_greedy", ("gains", "{policy}", "greedy", "gain")),
)


def _get(result: dict, path: tuple[str, ...], policy: str, source: str) -> Any:
    node: Any = result
    for part in path:
        try:
            node = node[part.format(policy=policy)]
        except (KeyError, TypeError):
            raise InputError(f"{source}: no {'.'.join(p.format(policy=policy) for p in path)} in the results") from None
    return node


def seed_row(result: dict, policy: str, source: str = "results") -> dict[str, Any]:
    """One seed's row: SFT and trained accuracies (sampled, greedy), and the gain with its paired
    interval and p-value, as that seed's evaluation computed them."""
    row = {name: _get(result, path, policy, source) for name, path in FIGURES}
    for mode in ("sampled", "greedy"):
        g = _get(result, ("gains", "{policy}", mode), policy, source)
        row[f"gain_{mode}_ci95"] = g["ci95"]
        row[f"gain_{mode}_p_value"] = g["p_value"]
    return row


def aggregate(results: dict[int, dict], policy: str, sources: dict[int, str] | None = None) -> dict[str, Any]:
    """{"seeds": {seed: row}, "aggregate": {figure: {mean, sd, n, ci95}}} over the seeds' results.

    The interval is across seeds (run-to-run variation: the seed of training, and of the evaluation's
    draws), a t-interval on the per-seed values; each row's own ci95 is the paired bootstrap over
    problems within that seed."""
    if not results:
        raise InputError("seeds: no per-seed results")
    sources = sources or {}
    rows = {seed: seed_row(r, policy, sources.get(seed, f"seed {seed}")) for seed, r in sorted(results.items())}
    agg = {}
    for name, _ in FIGURES:
        values = [row[name] for row in rows.values()]
        n = len(values)
        mean = sum(values) / n
        sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else None
        ci = t_interval(values)
        agg[name] = {"mean": mean, "sd": sd, "n": n, "ci95": list(ci) if ci else None}
    return {"policy": policy, "seeds": {str(s): row for s, row in rows.items()}, "aggregate": agg,
            "interval": f"t-interval ({LEVEL:.0%}) of the mean across seeds, n - 1 degrees of freedom"}
