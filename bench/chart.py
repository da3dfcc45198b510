"""The throughput chart (matplotlib, Agg backend): docs/img/throughput.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def throughput(summary: list[Any], path: Path) -> str | None:
    """Median tasks/s per system, one group per (workload, pool); returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups: list[tuple[str, str]] = []
    systems: list[str] = []
    for s in summary:
        if (s.workload, s.pool) not in groups:
            groups.append((s.workload, s.pool))
        if s.system not in systems:
            systems.append(s.system)
    by = {(s.workload, s.pool, s.system): s for s in summary}
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=100)
    width = 0.8 / max(1, len(systems))
    cmap = plt.get_cmap("tab10")
    for j, system in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for i, (workload, pool) in enumerate(groups):
            s = by.get((workload, pool, system))
            if s is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(s.rate)
            lo.append(s.rate - min(s.rates))
            hi.append(max(s.rates) - s.rate)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=system, color=cmap(j % 10),
               edgecolor="black" if system.startswith("idem/") else None)
    ax.set_xticks(range(len(groups)), [f"{w}\n-P {p}" for w, p in groups])
    ax.set_ylabel("tasks/s (median; bars: min-max over repetitions)")
    ax.set_title("End-to-end throughput, no-op tasks, Redis broker and backend (2 CPUs, shared)")
    ax.legend(ncol=4, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)
