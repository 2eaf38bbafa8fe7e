"""Where a training run's figures go: the loop (rloo/train/loop.py) logs through a RunLog and knows no
tracking service. The pipeline's stages hand it MLflow's (rloo_workflow.tracking.STAGE_LOG); a notebook a
`log(metrics, step)` callable (`RunLog.of`), or nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _nothing(*_args: object) -> None:
    return None


@dataclass(frozen=True)
class RunLog:
    """`metrics(values, step)` each step's figures; `history(records, start)` the steps a resumed run had
    done before its checkpoint (default: each again through `metrics`); `tags(values)` labels of the
    run (a divergence, say; default: none)."""

    metrics: Callable[[dict, int], None] = _nothing
    history: Callable[[list[dict], int], None] | None = None
    tags: Callable[[dict[str, str]], None] = _nothing

    def replay(self, records: list[dict], start: int) -> None:
        if self.history is not None:
            self.history(records, start)
            return
        for record in records:
            self.metrics(record, int(record.get("step", start)))

    @classmethod
    def of(cls, log: RunLog | Callable[[dict, int], None] | None) -> RunLog:
        """A RunLog from a `log(metrics, step)` callable (None: log nothing)."""
        if isinstance(log, RunLog):
            return log
        return cls() if log is None else cls(metrics=log)
