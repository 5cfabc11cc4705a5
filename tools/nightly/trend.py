"""The trend page: one small SVG panel per figure over every run in a
directory, the baseline as a dashed line, regressions as red points.

A static HTML file with inline SVG: no plotting library, opens anywhere,
can be published as a CI artifact.
"""

import html
import json
from pathlib import Path
from typing import Any

W, H, PAD = 260, 90, 8


def load_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Every nightly result in ``out_dir``, oldest first."""
    runs = []
    for path in sorted(out_dir.glob("nightly-*.json")):
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(runs, key=lambda r: r.get("created", ""))


def _panel(name: str, points: list[tuple[float, bool]],
           baseline: Any) -> str:
    values = [v for v, _ in points] + (
        [baseline] if isinstance(baseline, (int, float)) else [])
    low, high = min(values), max(values)
    span = (high - low) or (abs(high) or 1.0)
    low, high = low - 0.1 * span, high + 0.1 * span

    def y(v: float) -> float:
        return H - PAD - (v - low) / (high - low) * (H - 2 * PAD)

    def x(i: int) -> float:
        return PAD + (i * (W - 2 * PAD) / max(1, len(points) - 1))

    parts = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             f'<rect width="{W}" height="{H}" fill="#fafafa" '
             'stroke="#ddd"/>']
    if isinstance(baseline, (int, float)):
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y(baseline):.1f}"'
                     f' y2="{y(baseline):.1f}" stroke="#888" '
                     'stroke-dasharray="4 3"/>')
    if len(points) > 1:
        line = " ".join(f"{x(i):.1f},{y(v):.1f}"
                        for i, (v, _) in enumerate(points))
        parts.append(f'<polyline points="{line}" fill="none" '
                     'stroke="#36c"/>')
    for i, (v, bad) in enumerate(points):
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" '
                     f'fill="{"#d22" if bad else "#36c"}">'
                     f'<title>{v:.4g}</title></circle>')
    parts.append("</svg>")
    last = points[-1][0] if points else None
    label = html.escape(name)
    return (f'<div class="p"><div class="n">{label}</div>{"".join(parts)}'
            f'<div class="v">last {last:.4g}'
            + (f", baseline {baseline:.4g}"
               if isinstance(baseline, (int, float)) else "") +
            "</div></div>")


def write_trend(out_dir: Path, baseline: dict[str, Any]) -> Path:
    runs = load_runs(out_dir)
    names = list(baseline.get("figures", {}))
    for run in runs:
        names += [n for n in run["figures"] if n not in names]
    panels = []
    for name in names:
        points = [(run["figures"][name], name in run.get("regressions", ()))
                  for run in runs if name in run["figures"]]
        if points:
            panels.append(_panel(name, points,
                                 baseline.get("figures", {}).get(name)))
    bad = [r for r in runs if r.get("regressions")]
    head = (f"<h1>Nightly regression: {len(runs)} run(s) in "
            f"{html.escape(str(out_dir))}</h1><p>Dashed: the baseline "
            f"({html.escape(baseline.get('created', '?'))}). Red: a "
            f"regression against it. {len(bad)} run(s) with regressions"
            + "".join(f"<br>{html.escape(r['created'])}: "
                      f"{html.escape(', '.join(r['regressions']))}"
                      for r in bad) + "</p>")
    style = ("<style>body{font-family:sans-serif;margin:1em}"
             ".p{display:inline-block;margin:4px;font-size:11px}"
             ".n{width:260px;overflow-wrap:anywhere}</style>")
    page = out_dir / "trend.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'>"
                    f"<title>nightly</title>{style}</head><body>{head}"
                    f"{''.join(panels)}</body></html>")
    return page
