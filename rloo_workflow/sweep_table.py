"""A sweep's table (the `sweep` target): one row per point of the grid (rloo_workflow.pipeline.sweep_grid) with
its validation and test figures, and `best`, chosen by validation accuracy, never by the test figures."""

from __future__ import annotations

from typing import Any

from rloo.errors import InputError
from rloo_workflow.pipeline import point_label


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
            "point": pid, "label": point_label(values), "values": values,
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
            "points": {pid: {"label": point_label(v), "values": v} for pid, v in points.items()},
            "rows": rows, "best": best and {"point": best["point"], "label": best["label"], "values": best["values"],
                                             "val_accuracy_sampled": best["val_accuracy_sampled"]},
            "best_by": "val_accuracy_sampled (the validation split; test figures never choose)"}
