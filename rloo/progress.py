"""A long stage's progress as plain lines, at most one every `progress_every_s` seconds (the config's key):

    rloo: step 120/480 (25%) · reward 0.62 · kl 0.11 · 1.4 s/step · ETA 8 min

Each line goes where `rloo.console.console` sends a line a person should see: the stage's log, and the
terminal too where that is another file (a Snakemake job: its stderr is its log, its stdout the terminal
of a local run or the job's own log under Slurm). No progress bar: a bar's carriage-return redraws
would fill a log file with thousands of half lines, and a terminal that is not the log never saw them.
"""

from __future__ import annotations

import logging
import time

from rloo.console import console

log = logging.getLogger("rloo.progress")
# The weight of the latest window (the units since the last line) in the pace a line shows: a mean since
# the start would take the whole run to notice that the machine got faster or slower (a job that ran
# beside another, then alone, showed 1.3 s/step and "ETA 9 min" while doing 0.33 s/step).
RECENT = 0.7


def duration(seconds: float) -> str:
    """`seconds` as a person reads a wait: 45 s, 8 min, 2.5 h."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def speed(seconds_per_unit: float, unit: str) -> str:
    """The pace: `1.4 s/step` from a second per unit up, `12.5 steps/s` below."""
    if seconds_per_unit >= 1 or seconds_per_unit <= 0:
        return f"{seconds_per_unit:.1f} s/{unit}"
    return f"{1 / seconds_per_unit:.1f} {unit}s/s"


class Progress:
    """Counts `total` units of `name` (`initial` done already: a resumed run) and reports them as one line
    (`line`) every `every_s` seconds; at the end (`close`), a last line where it reported at all, so a
    short pass (a validation inside training) stays silent. `figures` (`update`, `show`) are the latest
    values shown after the count: `loss 0.412`. Off (`enabled=False`): counts, writes nothing (a
    data-parallel run's ranks but the first)."""

    def __init__(self, name: str, total: int, every_s: float, *, unit: str = "step", initial: int = 0,
                 enabled: bool = True) -> None:
        self.name, self.total, self.every_s, self.unit = name, total, every_s, unit
        self.done = self.start = initial
        self.enabled = enabled
        self.figures: dict[str, str] = {}
        self.lines = 0  # lines written so far
        self._t0 = self._last = time.monotonic()
        self._shown = initial  # the count on the last line
        self._recent: float | None = None  # seconds per unit as of the last line

    def show(self, **figures: str) -> None:
        """Keep the latest `figures` for the next line (`loss="0.412"`)."""
        self.figures.update(figures)

    def update(self, n: int = 1, **figures: str) -> None:
        """`n` more units done (and the latest `figures`); a line where `every_s` has passed since the last."""
        self.done += n
        self.show(**figures)
        now = time.monotonic()
        if self.enabled and now - self._last >= self.every_s:
            self._write(now)

    def line(self, now: float | None = None) -> str:
        """`name: unit done/total (share) · figures · pace · ETA` (at the end: the time it took)."""
        now = time.monotonic() if now is None else now
        elapsed, counted = now - self._t0, self.done - self.start
        parts = [f"{self.name}: {self.unit} {self.done}/{self.total}"
                 + (f" ({self.done / self.total:.0%})" if self.total else "")]
        parts += [f"{k} {v}" for k, v in self.figures.items()]
        if counted > 0 and (per_unit := self._pace(now)) is not None:
            parts.append(speed(per_unit, self.unit))
            left = max(self.total - self.done, 0)
            parts.append(f"ETA {duration(per_unit * left)}" if left else f"took {duration(elapsed)}")
        return " · ".join(parts)

    def _pace(self, now: float) -> float | None:
        """Seconds per unit, recent: the window since the last line, blended (RECENT) with the pace of the
        lines before; the first line's window is the whole pass so far."""
        if (counted := self.done - self._shown) <= 0:
            return self._recent
        window = (now - self._last) / counted
        return window if self._recent is None else RECENT * window + (1 - RECENT) * self._recent

    def _write(self, now: float) -> None:
        self._recent = self._pace(now)
        self._last, self._shown = now, self.done
        self.lines += 1
        console(self.line(now), log, level=logging.INFO)

    def close(self) -> None:
        """The last line, where the pass reported before and counted more since."""
        if self.enabled and self.lines and self.done != self._shown:
            self._write(time.monotonic())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:  # an error or a stop says why itself; no line claims the pass went on
            self.close()
