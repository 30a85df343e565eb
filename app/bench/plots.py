"""The benchmark report's plots (``python -m app.bench report``): throughput and goodput against concurrency,
TTFT, TPOT and ITL percentiles, as PNG files next to the markdown. matplotlib is optional (the ``bench``
extra); without it the report has its tables only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.bench.report_sources import Source
    from app.bench.report_tables import ServerRuns


def pyplot():
    """matplotlib's pyplot on a file backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(sweeps: list[Source], server_runs: list[ServerRuns], directory: Path) -> list[Path]:
    """PNG plots of the sweeps and of each server's W1 latency percentiles; [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    sweeps = [s for s in sweeps if s.data.get("levels")]
    ticks = sorted({int(c) for s in sweeps for c in s.data["levels"]})

    def concurrency_axis(ax) -> None:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)

    if sweeps:
        fig, (tput, good) = plt.subplots(1, 2, figsize=(11, 4))
        for s in sweeps:
            levels = sorted((int(c), r) for c, r in s.data["levels"].items() if r.get("num_requests"))
            xs = [c for c, _ in levels]
            label = f"{s.data.get('sweep', 'sweep')} {s.ref}"
            tput.plot(xs, [r["output_tok_per_s"] for _, r in levels], marker="o", label=label)
            good.plot(xs, [(r.get("goodput") or {}).get("req_per_s", 0) for _, r in levels], marker="o", label=label)
        for ax, title, unit in ((tput, "Throughput", "output tokens/s"), (good, "Goodput", "requests/s meeting the SLO")):
            concurrency_axis(ax)
            ax.set_ylabel(unit)
            ax.set_title(title)
            ax.legend()
        written.append(_save(fig, plt, directory / "sweep-throughput.png"))
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (metric, title, scale) in zip(axes, (("ttft_s", "TTFT (s)", 1), ("tpot_ms", "TPOT (ms)", 1), ("itl_ms", "ITL (ms)", 1))):
            for s in sweeps:
                levels = sorted((int(c), r) for c, r in s.data["levels"].items() if r.get(metric))
                for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                    ax.plot([c for c, _ in levels], [r[metric][q] * scale for _, r in levels], style, marker="o",
                            label=f"{s.data.get('sweep', 'sweep')} {q}")
            concurrency_axis(ax)
            ax.set_yscale("log")
            ax.set_title(title)
            ax.legend(fontsize=7)
        written.append(_save(fig, plt, directory / "sweep-latency.png"))
    found = [s for s in server_runs if (s.runs.get("W1") or {}).get("ttft_s")]
    if found:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        width = 0.8 / len(found)
        for ax, (metric, title) in zip(axes, (("ttft_s", "W1 TTFT (s)"), ("tpot_ms", "W1 TPOT (ms)"), ("itl_ms", "W1 ITL (ms)"))):
            for i, s in enumerate(found):
                values = s.runs["W1"].get(metric) or {}
                ax.bar([q + i * width for q in range(3)], [values.get(q, 0) for q in ("p50", "p90", "p99")], width,
                       label=f"{s.name.replace('`', '')} {s.source.ref}")
            ax.set_xticks([q + width * (len(found) - 1) / 2 for q in range(3)], ["p50", "p90", "p99"])
            ax.set_title(title)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        written.append(_save(fig, plt, directory / "w1-latency.png"))
    return written


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
