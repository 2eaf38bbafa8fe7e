"""A sweep's table (the `sweep` target): one row per point of the grid (rloo_workflow.pipeline.sweep_grid) with
its validation and test figures, and `best`, chosen by validation accuracy, never by the test figures, with
its margin over the runner-up; points sharing the highest validation accuracy are a `tie`, not a best."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rloo.errors import InputError
from rloo.eval.report import sweep_row_line
from rloo.settings import Config
from rloo_workflow.pipeline import SWEEP_FOLDER, ConfigLike, point_label, sweep_grid, variant_fields

log = logging.getLogger("rloo.sweep")


def table(name: str, points: dict[str, dict[str, Any]], results: dict[str, dict], policy: str) -> dict[str, Any]:
    """The sweep's table: one row per point (its values, the validation accuracy of the RLOO checkpoint
    handed on, the test figures with their paired intervals) and the winner by validation accuracy
    (`winner`: `best` with its margin over the runner-up, or a `tie`). Test figures never choose: they
    would make `best`'s test accuracy optimistic."""
    rows = [point_row(name, pid, values, results[pid], policy) for pid, values in points.items()]
    return {"sweep": name, "policy": policy, "keys": list(next(iter(points.values()))) if points else [],
            "points": {pid: {"label": point_label(v), "values": v} for pid, v in points.items()},
            "rows": rows, **winner(rows),
            "best_by": "val_accuracy_sampled (the validation split; test figures never choose)"}


def point_row(name: str, pid: str, values: dict[str, Any], result: dict, policy: str) -> dict[str, Any]:
    """Point `pid`'s row of sweep `name` from its results file (`rloo report`): its values, the validation
    accuracy of the RLOO checkpoint handed on, the test figures with the gains' paired intervals."""
    trained_as = values.get("rloo.estimator", policy)  # a grid may set the estimator: the point's policy
    try:
        trained, sft = result["policies"][trained_as], result["policies"]["sft"]
        training = result["training"][trained_as]
        gain = result["gains"][trained_as]
    except KeyError as e:
        raise InputError(f"sweep {name}, point {pid}: no {e} in its results") from None
    return {
        "point": pid, "label": point_label(values), "values": values,
        # the validation accuracy (sampled) of the checkpoint the RLOO stage handed on (rloo.select)
        "val_accuracy_sampled": training.get("selected_val_accuracy_sampled"),
        "test": {"rloo_sampled": trained["accuracy_sampled"], "rloo_greedy": trained["accuracy"],
                 "sft_sampled": sft["accuracy_sampled"], "sft_greedy": sft["accuracy"],
                 "gain_sampled": gain["sampled"]["gain"], "gain_sampled_ci95": gain["sampled"]["ci95"],
                 "gain_greedy": gain["greedy"]["gain"], "gain_greedy_ci95": gain["greedy"]["ci95"]},
    }


def log_path(cfg: ConfigLike, name: str) -> Path:
    """Sweep `name`'s log, `<paths.logs>/sweep_<name>.log`: the sweep rule's log (workflow/rules/sweeps.smk,
    whose log the design doc's table is held to; tests/e2e/test_variants.py holds the two to one file), to
    which each point's line is appended as the point's report ends (`point_finished`)."""
    return Path(Config.of(cfg).paths.logs) / f"sweep_{name}.log"


def point_finished(cfg: ConfigLike, result_file: str | Path, result: dict) -> str | None:
    """Where `result_file` is a sweep point's results (`<paths.results>/sweeps/<name>/<point>/...`, written
    by its report job), append the point's line, and how many of the grid's points have results, to the
    sweep's log (`log_path`), so that the log shows each point as it finishes, long before the table.
    Returns the line (None for any other results file). Snakemake empties the log when the sweep job
    starts, which then writes every point's line and the winner."""
    sections = Config.of(cfg)
    try:
        folder = Path(result_file).resolve().parent.relative_to(Path(sections.paths.results).resolve())
        kind, fields = variant_fields(folder.as_posix())
    except (ValueError, InputError):
        return None
    if kind != "sweep":
        return None
    name, pid = fields["sweep"], fields["point"]
    points = sweep_grid(sections, name)
    if pid not in points:
        return None
    done = sum((Path(sections.paths.results) / SWEEP_FOLDER.format(sweep=name, point=p) / Path(result_file).name).is_file()
               for p in points)
    row = point_row(name, pid, points[pid], result, sections.rloo.estimator)
    line = (f"{time.strftime('%H:%M:%S')} point {done} of {len(points)} done: "
            f"{sweep_row_line(sections.rloo.estimator, row)}")
    path = log_path(sections, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as e:  # a line of progress is not worth the point's results, which are written
        log.warning("sweep %s: could not append to %s: %s", name, path, e)
        return None
    return line


def winner(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`best` and `tie` of the sweep's rows, by validation accuracy alone. `best`: the point of highest
    validation accuracy, with the runner-up and the margin over it (`margin`: the difference of the two
    validation accuracies, a fraction; a sweep keeps one validation accuracy per point, so the margin has
    no interval; with one point, no runner-up and no margin), or None where no point has one (rloo.eval_every
    0) or where several share the highest: then `tie` names them (grid order would otherwise pick one
    that did no better than the others)."""
    scored = sorted((r for r in rows if r["val_accuracy_sampled"] is not None),
                    key=lambda r: r["val_accuracy_sampled"], reverse=True)  # stable: grid order among equals
    if not scored:
        return {"best": None, "tie": None}
    top = scored[0]["val_accuracy_sampled"]
    if len(tied := [r for r in scored if r["val_accuracy_sampled"] == top]) > 1:
        return {"best": None, "tie": {"points": [r["point"] for r in tied], "labels": [r["label"] for r in tied],
                                      "val_accuracy_sampled": top}}
    first, second = scored[0], scored[1] if len(scored) > 1 else None
    runner_up = None if second is None else {"point": second["point"], "label": second["label"],
                                             "val_accuracy_sampled": second["val_accuracy_sampled"]}
    return {"best": {"point": first["point"], "label": first["label"], "values": first["values"],
                     "val_accuracy_sampled": top, "runner_up": runner_up,
                     "margin": None if second is None else top - second["val_accuracy_sampled"]},
            "tie": None}
