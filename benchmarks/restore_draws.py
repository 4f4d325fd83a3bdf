"""A restore's first steps' draws at K sources: thread CPU before any store is opened.

    python benchmarks/restore_draws.py [--sources 1 256 1024] [--rounds 3] [--root DIR ...]

What a restored feed's reader computes of its first step before it opens a store: the
step's draws (`Plan.draws`: the mixture's rows, each source's epoch, window order and shard
order) and their shard pieces (`layout.window_pieces`), then the same for the next 7 steps
(the steps read and fetched ahead: a step of a big mixture draws sources the first did not),
and, after `WARMUP` more steps, the same per step of a run's steady state over `STEADY`
steps (where epochs roll over and a step draws mostly sources drawn before).
The mixtures are `mixture_bench.py`'s (K stores of 8 shards, equally weighted), planned from
the host's summaries (`plan_stores`) once per process; each of 15 restores is a new plan at a
step 10,000 steps past the previous one's, so every order it needs is new to the process (as
in a restored process), and reports the least and the median thread CPU over them. Each
(checkout, mixture) runs in a fresh process; `--root`: the checkouts to compare (default:
this one), alternated round by round.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import checkouts  # beside this file

JAX = {"JAX_PLATFORMS": "cpu"}  # the child's JAX
RESTORES = 15
AHEAD = 7
WARMUP, STEADY = 300, 300


def measure(config_file: Path) -> dict[str, list[float]]:
    """Thread CPU seconds of each restore's first step and of the `AHEAD` steps after it."""
    import gc

    import numpy as np

    from pipeline.config import parse_config
    from pipeline.plan.layout import window_pieces
    from pipeline.plan.sources import plan_stores
    from pipeline.read.plan import Plan

    config = parse_config(json.loads(config_file.read_text()), origin=str(config_file))
    stores = plan_stores(config)

    def pieces(plan: Plan, step: int) -> None:
        draws = plan.draws(step)
        layouts = plan.segment_plan(draws.segment_index).ordered_layouts
        drawn = draws.drawn
        mine = [layouts[k] for k in drawn]
        window_pieces(mine, np.searchsorted(drawn, draws.source), draws.epoch, draws.start)

    pieces(Plan.from_config(config, stores), 0)  # numpy's and the modules' first calls
    first, ahead = [], []
    for k in range(RESTORES):
        plan = Plan.from_config(config, stores)
        step = 10**6 + 10_000 * k
        gc.collect()
        started = time.thread_time()
        pieces(plan, step)
        first.append(time.thread_time() - started)
        started = time.thread_time()
        for later in range(step + 1, step + 1 + AHEAD):
            pieces(plan, later)
        ahead.append((time.thread_time() - started) / AHEAD)
    step += 1 + AHEAD
    for later in range(step, step + WARMUP):
        pieces(plan, later)
    steady = []
    for later in range(step + WARMUP, step + WARMUP + STEADY):
        started = time.thread_time()
        pieces(plan, later)
        steady.append(time.thread_time() - started)
    return {"first_s": first, "ahead_s": ahead, "steady_s": steady}


def main() -> None:
    started = checkouts.mixtures_start(__doc__.splitlines()[0], measure)
    if started is None:  # the child measured
        return
    args, roots, configs = started
    got: dict[tuple[int, int], dict[str, list[float]]] = {}
    for i, k, measures in checkouts.measured(__file__, roots, configs, args.rounds, **JAX):
        for key, values in measures.items():
            got.setdefault((i, k), {}).setdefault(key, []).extend(values)
    print(
        "checkout | sources | first step's draws + pieces, ms: least / median (x first "
        "checkout's median) | each of the next 7 steps, ms: least / median (x) | a steady "
        "step, ms: least / median (x)"
    )
    print("--- | ---: | ---: | ---: | ---:")
    medians = {}
    for (i, k), runs in sorted(got.items()):
        cells = []
        for key in ("first_s", "ahead_s", "steady_s"):
            values = sorted(runs[key])
            median = values[len(values) // 2]
            medians[i, k, key] = median
            base = medians.get((0, k, key), median)
            cells.append(f"{values[0] * 1e3:.2f} / {median * 1e3:.2f} ({median / base:.2f}x)")
        print(f"{roots[i]} | {k:,} | {' | '.join(cells)}")


if __name__ == "__main__":
    main()
