"""A big mixture's restore before its first step: CPU per source of the config and the plan.

    python benchmarks/restore_start.py [--sources 1 256 1024] [--rounds 3] [--root DIR ...]

What a restore pays per source before it reads a token: `parse_config` of the mixture's
config, then `DataFeed(config, mesh, step=10**6)` made (its stores planned from the host's
summaries, the plan laid out; no step read). The mixtures are `mixture_bench.py`'s (K stores
of 8 shards, equally weighted). Each (checkout, mixture) runs in a fresh process, after one
warm feed of the same config (JAX's first-call costs, and the summary file written), and
reports the least process CPU time of 7 configs parsed and of 15 feeds made, alone and to
their first global batch (at steps that draw other sources each time; the stores' opens and
shards' first uses included, as in `mixture_bench.py`'s wall-time restore + first batch):
CPU, not wall, and the least, so that the other work of a shared machine moves it little.
`--root`: the source checkouts to compare (default: this one), alternated round by round.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import checkouts  # beside this file

JAX = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
KEYS = ("parse_s", "start_s", "first_s")


def measure(config_file: Path) -> dict[str, float]:
    """One mixture in this (fresh) process: least CPU seconds of a parse and of a start."""
    import gc

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed

    raw = json.loads(config_file.read_text())
    parses = []
    for _ in range(7):
        started = time.process_time()
        config = parse_config(raw, origin=str(config_file))
        parses.append(time.process_time() - started)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with DataFeed(config, mesh, step=0) as warm:
        jax.block_until_ready(next(warm))
    starts, firsts = [], []
    for k in range(15):
        gc.collect()
        started = time.process_time()
        feed = DataFeed(config, mesh, step=10**6 + 7 * k)
        starts.append(time.process_time() - started)
        jax.block_until_ready(next(feed))
        firsts.append(time.process_time() - started)
        feed.close()
    return {"parse_s": min(parses), "start_s": min(starts), "first_s": min(firsts)}


def main() -> None:
    started = checkouts.mixtures_start(__doc__.splitlines()[0], measure)
    if started is None:  # the child measured
        return
    args, roots, configs = started
    got: dict[tuple[int, int], list[dict]] = {}
    for i, k, measures in checkouts.measured(__file__, roots, configs, args.rounds, **JAX):
        got.setdefault((i, k), []).append(measures)
    print(
        "checkout | sources | parse_config, ms (us a source) | DataFeed start, ms (us a source) "
        "| start + first batch, ms (x 1 source)"
    )
    print("--- | ---: | ---: | ---: | ---:")
    for (i, k), runs in sorted(got.items()):
        parse, start, first = (min(run[key] for run in runs) for key in KEYS)
        one = min(run["first_s"] for run in got[i, min(configs)])
        print(
            f"{roots[i]} | {k:,} | {parse * 1e3:.2f} ({parse / k * 1e6:.1f}) "
            f"| {start * 1e3:.2f} ({start / k * 1e6:.1f}) | {first * 1e3:.1f} ({first / one:.1f})"
        )


if __name__ == "__main__":
    main()
