"""`pipeline plot`: target weight and realised share of each source per step, as a PNG.

Lines: each source's normalised schedule weight at each step (what the config asks for).
Steps: the share of the step's global batch the source actually got (from the plan's draws).
Vertical lines: stage boundaries; red ones: the ledger's entries (a switch, a geometry change, a
take-down, a skip), red ticks at the bottom: its set_mix calls; triangles: a source starts a new
epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import ConfigError
from pipeline.extras import require
from pipeline.plan.ledger import Ledger
from pipeline.plan.report import rollovers_between, stage_rows, target_shares
from pipeline.read.plan import Plan
from pipeline.wording import counted

MAX_POINTS = 1500  # steps sampled for the realised share over long ranges


def plot_mixture(plan: Plan, start: int, stop: int, out: Path, title: str = "") -> None:
    matplotlib = require("matplotlib", "plot", "pipeline plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase
    from matplotlib.ticker import MaxNLocator

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(out).suffix.lstrip(".").lower() not in formats:
        raise ConfigError(
            f"--out {out}: the file name must end with an image format matplotlib writes "
            f"({', '.join(f'.{name}' for name in sorted(formats))})"
        )
    stride = max(1, -(-(stop - start) // MAX_POINTS))
    steps = np.arange(start, stop, stride)
    targets = target_shares(plan, steps)
    realised: dict[str, np.ndarray] = {name: np.zeros(len(steps)) for name in targets}
    for i, step in enumerate(steps):
        draws = plan.draws(int(step))
        for s in np.unique(draws.source):
            name = draws.source_names[s]
            realised.setdefault(name, np.zeros(len(steps)))[i] = np.mean(draws.source == s)
    names = sorted(set(targets) | set(realised))
    colors = dict(zip(names, plt.get_cmap("tab10").colors))

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    window = max(1, len(steps) // 40)  # moving average over ~1/40 of the range
    for name in names:
        color = colors[name]
        share = realised.get(name, np.zeros(len(steps)))
        ax.plot(
            steps,
            share,
            linestyle="none",
            marker=".",
            markersize=3,
            color=color,
            alpha=0.3,
            label=f"{name}: realised share of a step",
        )
        if window > 1:
            smooth = np.convolve(share, np.ones(window) / window, mode="valid")
            ax.step(
                steps[window // 2 : window // 2 + len(smooth)],  # centred
                smooth,
                where="post",
                color=color,
                linewidth=1.2,
                linestyle="--",
                label=f"{name}: realised, mean of {window * stride} steps",
            )
        ax.plot(
            steps,
            targets.get(name, np.zeros(len(steps))),
            color=color,
            linewidth=2.2,
            alpha=0.8,
            label=f"{name}: target weight",
        )
    top = 1.08
    rollovers = rollovers_between(plan, start, stop)
    for k, name in enumerate(names):
        at = [s for s in rollovers.get(name, []) if start <= s < stop]
        if at:
            ax.plot(
                at,
                np.full(len(at), top - 0.025 * (k + 1)),
                linestyle="none",
                marker="v",
                markersize=7,
                color=colors[name],
                markeredgecolor="black",
                markeredgewidth=0.5,
                label=f"{name}: new epoch ({len(at)})",
            )
    for row in stage_rows(plan):
        at = row.start_step if row.joined_at is None else row.joined_at  # a switch into it
        if start < at < stop or (at == start and start > 0):
            ax.axvline(at, color="0.3", linestyle="--", linewidth=1)
            ax.text(
                at,
                0.9,
                f"{row.name} ",
                rotation=90,
                va="top",
                ha="right",
                fontsize=9,
                color="0.2",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
                transform=ax.get_xaxis_transform(),
            )
    lines, mixes = interventions(plan.ledger, start, stop)
    for at, label in lines:
        ax.axvline(at, color="red", linewidth=1.6)
        ax.text(
            at,
            0.02,
            label,
            rotation=90,
            va="bottom",
            ha="left",
            fontsize=9,
            color="red",
            transform=ax.get_xaxis_transform(),
        )
    if len(mixes):
        total = len(plan.ledger.mixes)  # `stages` counts them all; the plot shows its range
        calls = counted(total, "call")
        if len(mixes) < total:
            calls = f"{len(mixes)} of its {calls}: those in steps {start:,}..{stop - 1:,}"
        ax.plot(
            mixes,
            np.full(len(mixes), 0.01),
            linestyle="none",
            marker="|",
            markersize=9,
            color="red",
            transform=ax.get_xaxis_transform(),
            label=f"ledger set_mix ({calls})",
        )
    ax.set_xlim(start, stop - 1 if stop - 1 > start else stop)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 2.5 on a short range
    ax.set_ylim(-0.02, top)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of the global batch")
    sizes = sorted({plan.batch_size(int(step)) for step in steps})
    batch = f"batch {sizes[0]}" if len(sizes) == 1 else f"batch {sizes[0]}..{sizes[-1]}"
    ax.set_title(
        f"{title}\ntarget weight vs realised share per step ({batch})"
        + (f", every {stride} steps" if stride > 1 else "")
    )
    ax.grid(alpha=0.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def interventions(
    ledger: Ledger, start: int, stop: int
) -> tuple[list[tuple[int, str]], np.ndarray]:
    """The ledger's entries in steps [start, stop): each later segment's start step and label
    (a switch, a take-down, a skip, or several: a line), and the steps of its set_mix calls
    (ticks: an adaptive run makes one every few steps)."""
    lines = [
        (segment.start_step, f" ledger {_kind(ledger.entry(index))} (segment {index})")
        for index, segment in enumerate(ledger.segments[1:], start=1)
        if start <= segment.start_step < stop
    ]
    steps = ledger.mixes.steps
    return lines, steps[(steps >= start) & (steps < stop)]


def _kind(entry: str) -> str:
    """`switch` / `skip N steps` of a ledger entry: what fits beside a line in the figure (the
    changed keys are listed by `pipeline stages --ledger`)."""
    return "; ".join(part.split(":")[0].split(" (")[0] for part in entry.split("; "))
