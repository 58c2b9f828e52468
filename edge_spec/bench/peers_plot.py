"""The README's results plot: per category, our default against our own ``ar`` and each category's fastest
peer mode, from a ``benchmarks/spec_peers.py`` run (its saved records, re-tabled as :func:`peers.report` does)."""

from __future__ import annotations

from pathlib import Path

from edge_spec.bench.headline import OUR_AR, lead, speeds
from edge_spec.bench.peers import summarize


def fastest_peers(summary: list[dict], ours: str) -> list[tuple[str, float, float, str, float]]:
    """(category, our default's tok/s, our ar's, the fastest peer mode, its tok/s) per category, overall last."""
    categories = list(dict.fromkeys(r["category"] for r in summary))
    categories = [c for c in categories if c != "overall"] + ["overall"]
    rows = []
    for category in categories:
        item = lead(summary, category, ours)
        rows.append((category, item.ours, speeds(summary, category)[OUR_AR], item.peer, item.peer_speed))
    return rows


def plot_peers(records: list[dict], path: Path, ours: str = "ours schedule+suffix", title: str = "") -> bool:
    """Grouped bars, tok/s per category; False (nothing written) without matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = summarize(records, list(dict.fromkeys(r["engine"] for r in records)))
    rows = fastest_peers(summary, ours)
    fig, ax = plt.subplots(figsize=(10, 4.6))
    width = 0.27
    xs = range(len(rows))
    bars = (
        ("edge-spec default", [r[1] for r in rows], "#2b7bba", -width),
        ("fastest peer mode", [r[4] for r in rows], "#f28e2b", 0.0),
        ("edge-spec ar", [r[2] for r in rows], "#9aa5b1", width),
    )
    for label, values, color, offset in bars:
        ax.bar([x + offset for x in xs], values, width, label=label, color=color)
    for x, row in zip(xs, rows):
        ax.annotate(
            row[3], (x, row[4]), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=6.5, rotation=90
        )
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=9)
    ax.set_ylabel("decode tokens / s (greedy)")
    ax.set_ylim(0, max(max(r[1], r[4]) for r in rows) * 1.35)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
