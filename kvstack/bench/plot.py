"""The ``kvstack bench`` picture: quality (KL vs. the full cache, log scale) against measured memory ratio.

One curve per preset family (its ratio runs joined in memory order), baselines as single markers, and the run's
Pareto front (no other row has both less memory and lower KL) drawn as a dashed line through ringed points. A KL at
float-rounding level (the full cache, the identity stack: below ``EXACT_KL``) would stretch the log axis over ten
decades of noise, so every KL is floored at a tenth of the smallest KL above that level; the axis label says so.
Rendered with matplotlib's Agg canvas (no display, no global pyplot state) to a PNG.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from .harness import EXACT_KL
BASELINE_MARKERS = {"full-cache": "*", "QuantizedCache": "s"}


def kl_floor(kls: list[float]) -> float:
    measurable = [k for k in kls if k > EXACT_KL]
    return min(measurable) / 10 if measurable else 1e-6


def plot_quality_vs_memory(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Draw ``rows`` (``BenchRow.as_dict()``: name, family, kind, memory_ratio, kl, pareto) into a PNG at ``path``."""
    floor = kl_floor([r["kl"] for r in rows])
    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    families: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        families[row["family"]].append(row)
    for family, members in families.items():
        members = sorted(members, key=lambda r: r["memory_ratio"])
        xs = [r["memory_ratio"] for r in members]
        ys = [max(r["kl"], floor) for r in members]
        baseline = members[0]["kind"] == "baseline"
        if baseline:
            marker = BASELINE_MARKERS.get(family, "D")
            ax.scatter(xs, ys, marker=marker, s=90, zorder=3, label=family)
            for r, x, y in zip(members, xs, ys):
                if r["name"] != family:  # QuantizedCache rows say which backend and bits
                    ax.annotate(r["name"].removeprefix(family), (x, y), textcoords="offset points", xytext=(6, 4),
                                fontsize=7)
        else:
            ax.plot(xs, ys, marker="o", linewidth=1.5, zorder=2, label=family)

    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["memory_ratio"])
    if front:
        fx = [r["memory_ratio"] for r in front]
        fy = [max(r["kl"], floor) for r in front]
        ax.plot(fx, fy, linestyle="--", color="black", linewidth=1, zorder=1, label="Pareto front")
        ax.scatter(fx, fy, s=180, facecolors="none", edgecolors="black", linewidths=1.2, zorder=4)

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("memory ratio (cache bytes after the prefix / full cache, same tokens)")
    ax.set_ylabel(f"KL vs. full cache (nats/token, floored at {floor:.1e})")
    ax.set_ylim(bottom=floor / 2)
    ax.set_title(title or "quality vs. memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
