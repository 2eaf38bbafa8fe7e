"""Sweeps (`sweeps.<name>: {key.path: [values], ...}`): the grid's points, each a variant of the chain
that reruns only the stages reading a key it sets (rloo.pipeline.reads_key), and the sweep's table with
`best` chosen by validation accuracy, never by the test figures."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from rloo.errors import InputError
from rloo.pipeline import CHAIN, SWEEP_FOLDER, Variant, downstream_closure, reads_key


def point_id(values: dict[str, Any]) -> str:
    """A short stable id of a point (its folder, and its DVC stage's name: DVC takes no `.`, `=` or `/`
    there); the JSON maps each id to its values and its readable label."""
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return "p" + hashlib.sha256(blob.encode()).hexdigest()[:8]


def label(values: dict[str, Any]) -> str:
    """`rloo.beta=0.1,rloo.k=2`: the point as a person reads it (MLflow run names, the table)."""
    return ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items())


def grid(cfg: dict, name: str) -> dict[str, dict[str, Any]]:
    """{point id: {key: value}}: the cartesian product of `sweeps.<name>`, in the order the grid lists it."""
    try:
        axes = cfg["sweeps"][name]
    except KeyError:
        raise InputError(f"no sweep named '{name}' (config key sweeps.{name}); sweeps: "
                         f"{', '.join(cfg.get('sweeps') or {}) or 'none'}") from None
    keys = list(axes)
    return {point_id(p): p for p in (dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values()))}


def varied_stages(cfg: dict, name: str) -> frozenset[str]:
    """The chain stages a point of sweep `name` runs itself: those reading a swept key, and what follows them."""
    keys = list(cfg["sweeps"][name])
    return downstream_closure({s for s in CHAIN if any(reads_key(cfg, s, k) for k in keys)}, cfg)


def sweep_variant(cfg: dict, name: str, point: str) -> Variant:
    """Point `point` of sweep `name` as a variant of the chain (a template point id, not in the grid,
    gets the grid's first values: the DVC compiler's template job)."""
    points = grid(cfg, name)
    values = points.get(point) or next(iter(points.values()))
    return Variant(SWEEP_FOLDER.format(sweep=name, point=point), f"sweep={name},{label(values)}",
                   dict(values), varied_stages(cfg, name))


def table(name: str, points: dict[str, dict[str, Any]], results: dict[str, dict], policy: str) -> dict[str, Any]:
    """The sweep's table: one row per point (its values, the validation accuracy of the RLOO checkpoint
    handed on, the test figures) and `best`, the point of highest validation accuracy (ties: the first
    in grid order). Test figures never choose: they would make `best`'s test accuracy optimistic."""
    rows = []
    for pid, values in points.items():
        r = results[pid]
        trained_as = values.get("rloo.estimator", policy)  # a grid may set the estimator: the point's policy
        try:
            trained, sft = r["policies"][trained_as], r["policies"]["sft"]
            training = r["training"][trained_as]
            gain = r["gains"][trained_as]
        except KeyError as e:
            raise InputError(f"sweep {name}, point {pid}: no {e} in its results") from None
        rows.append({
            "point": pid, "label": label(values), "values": values,
            # the validation accuracy (sampled) of the checkpoint the RLOO stage handed on (rloo.select)
            "val_accuracy_sampled": training.get("selected_val_accuracy_sampled"),
            "test": {"rloo_sampled": trained["accuracy_sampled"], "rloo_greedy": trained["accuracy"],
                     "sft_sampled": sft["accuracy_sampled"], "sft_greedy": sft["accuracy"],
                     "gain_sampled": gain["sampled"]["gain"], "gain_sampled_ci95": gain["sampled"]["ci95"],
                     "gain_greedy": gain["greedy"]["gain"], "gain_greedy_ci95": gain["greedy"]["ci95"]},
        })
    scored = [r for r in rows if r["val_accuracy_sampled"] is not None]
    best = max(scored, key=lambda r: r["val_accuracy_sampled"], default=None)  # max keeps the first of ties
    return {"sweep": name, "policy": policy, "keys": list(next(iter(points.values()))) if points else [],
            "points": {pid: {"label": label(v), "values": v} for pid, v in points.items()},
            "rows": rows, "best": best and {"point": best["point"], "label": best["label"], "values": best["values"],
                                             "val_accuracy_sampled": best["val_accuracy_sampled"]},
            "best_by": "val_accuracy_sampled (the validation split; test figures never choose)"}
