"""A run's figures against the baseline's, with a tolerance per figure.

The baseline file holds ``figures`` (name -> value) and ``tolerances``, a
list checked in order, the first whose ``match`` (fnmatch pattern) fits a
figure's name deciding:

- ``exact``: the value must equal the baseline's (token equality, counts,
  invariants);
- ``points``: may fall at most ``band`` below the baseline (acceptance, in
  percentage points); a rise is reported, not a regression;
- ``ratio``: may move at most ``band`` (a fraction) in its worse direction,
  ``better: higher`` (tokens/s, speedups) or ``lower`` (host ms per step,
  memory);
- ``info``: printed, never a regression.

A baseline's own ``tolerances`` come first; then the defaults below
(``TOLERANCES``: the nightly's and CI's smoke), which is all a baseline
written by ``--update-baseline`` for a new model has. A figure no tolerance
matches must be exact.

A figure of the baseline missing from the run is a regression (something
that was measured no longer is); a new figure is listed, not checked.
"""

import fnmatch
from dataclasses import dataclass
from typing import Any, Optional


def _tolerances(mtp_over_no_mtp: float, host_ms_per_step: float,
                draft_over_target: float) -> list[dict[str, Any]]:
    return [
        # Token equality and invariants: exact.
        {"match": "accuracy.*", "kind": "exact"},
        {"match": "invariant.*", "kind": "exact"},
        # The speculation watchdog's pauses: none on the trained MTP layer,
        # one on a collapsed one.
        {"match": "watchdog.*", "kind": "exact"},
        # vLLM's acceptance, per position and its distance from the offline
        # reference: at most 2 points below the baseline.
        {"match": "acceptance.*", "kind": "points", "band": 2.0},
        # Speed: ratios measured in the same run, bands wide enough for a
        # shared 2-core machine (one run's tokens/s moves 10-20% with load),
        # narrow enough that a drafter stalled on the host falls outside;
        # absolute tokens/s are only shown.
        {"match": "speed.*.mtp_over_no_mtp", "kind": "ratio",
         "band": mtp_over_no_mtp, "better": "higher"},
        {"match": "speed.*.graph_over_eager", "kind": "ratio", "band": 0.35,
         "better": "higher"},
        {"match": "speed.*.host_ms_per_step", "kind": "ratio",
         "band": host_ms_per_step, "better": "lower"},
        {"match": "speed.*.draft_over_target", "kind": "ratio",
         "band": draft_over_target, "better": "lower"},
        {"match": "speed.*.tokens_per_s", "kind": "info"},
        # The per-step cost through the double (tools.bench.step_cost):
        # kernels, syncs, MoE bytes and weight formats are counts, exact
        # (a fix moves them on purpose: refresh the baseline); host time
        # as the MTP / no-MTP ratio of one run, generous; absolute host
        # milliseconds only shown.
        {"match": "cost.*.host_mtp_over_no_mtp", "kind": "ratio",
         "band": 1.0, "better": "lower"},
        {"match": "cost.*.host_ms_per_step", "kind": "info"},
        {"match": "cost.*.host_added_over_no_mtp", "kind": "info"},
        {"match": "cost.*", "kind": "exact"},
        # Peak RSS within 25% (Python, torch and vLLM themselves move it by
        # tens of MiB between runs); weights, draft-owned weights and KV
        # cache within 2%.
        {"match": "memory.*.peak_rss_mib", "kind": "ratio", "band": 0.25,
         "better": "lower"},
        {"match": "memory.*", "kind": "ratio", "band": 0.02,
         "better": "lower"},
    ]


# The default tolerances per nightly plan, first match wins. "full": MTP/
# no-MTP and graph/eager may fall 35%, host ms per step double, the draft's
# cost per target step grow 60%. "smoke" (CI, measured next to other jobs):
# MTP/no-MTP may fall 75%, host ms per step grow 4x, the draft's cost per
# target step 2.5x; wide, but a drafter slowed by a host stall
# (tests/nightly) still falls far outside.
TOLERANCES: dict[str, list[dict[str, Any]]] = {
    "full": _tolerances(0.35, 1.0, 0.6),
    "smoke": _tolerances(0.75, 3.0, 1.5),
}


@dataclass
class Row:
    name: str
    baseline: Optional[float]
    now: Optional[float]
    rule: str
    regression: bool
    moved: bool

    @property
    def status(self) -> str:
        if self.regression:
            return "REGRESSION"
        if self.baseline is None:
            return "new"
        return "moved" if self.moved else "ok"


def tolerance_for(name: str, tolerances: list[dict[str, Any]]) -> dict:
    for tol in tolerances:
        if fnmatch.fnmatchcase(name, tol["match"]):
            return tol
    return {"kind": "exact"}


def _describe(tol: dict[str, Any]) -> str:
    kind = tol["kind"]
    if kind == "points":
        return f"-{tol['band']:g} pt"
    if kind == "ratio":
        sign = "-" if tol.get("better", "higher") == "higher" else "+"
        return f"{sign}{tol['band']:.0%}"
    return kind


def check_figure(name: str, baseline: Optional[float], now: Optional[float],
                 tol: dict[str, Any]) -> Row:
    kind = tol["kind"]
    rule = _describe(tol)
    if baseline is None:
        return Row(name, None, now, rule, False, False)
    if now is None:
        return Row(name, baseline, None, rule, True, True)
    moved = now != baseline
    if kind == "exact":
        bad = now != baseline
    elif kind == "points":
        bad = now < baseline - tol["band"]
        moved = abs(now - baseline) > tol["band"]
    elif kind == "ratio":
        band = tol["band"]
        if tol.get("better", "higher") == "higher":
            bad = now < baseline * (1 - band)
        else:
            bad = now > baseline * (1 + band)
        moved = abs(now - baseline) > band * abs(baseline)
    elif kind == "info":
        bad = False
    else:
        raise ValueError(f"unknown tolerance kind {kind!r} for {name}")
    return Row(name, baseline, now, rule, bad, moved)


def compare(figures: dict[str, float], baseline: dict[str, Any],
            defaults: Optional[list[dict[str, Any]]] = None) -> list[Row]:
    """Each figure of the run and the baseline, checked with the baseline's
    own tolerances, then ``defaults`` (``TOLERANCES["full"]`` if None)."""
    tolerances = list(baseline.get("tolerances") or []) + list(
        TOLERANCES["full"] if defaults is None else defaults)
    names = list(baseline["figures"]) + [
        n for n in figures if n not in baseline["figures"]
    ]
    return [
        check_figure(n, baseline["figures"].get(n), figures.get(n),
                     tolerance_for(n, tolerances)) for n in names
    ]


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def table(rows: list[Row]) -> str:
    """What moved, by how much, against which tolerance."""
    shown = [r for r in rows if r.regression or r.moved
             or r.baseline is None]
    lines = [f"{'figure':64} {'baseline':>9} {'now':>9} {'change':>8} "
             f"{'tolerance':>9}  status"]
    for r in shown:
        change = ("-" if r.baseline is None or r.now is None else
                  f"{r.now - r.baseline:+.3g}")
        lines.append(f"{r.name:64} {_fmt(r.baseline):>9} {_fmt(r.now):>9} "
                     f"{change:>8} {r.rule:>9}  {r.status}")
    bad = sum(r.regression for r in rows)
    lines.append(f"{len(rows)} figures: {bad} regression(s), "
                 f"{sum(r.moved and not r.regression for r in rows)} moved "
                 f"within tolerance, {len(rows) - len(shown)} unchanged")
    return "\n".join(lines)
