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

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def child(root: Path, config_file: Path) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(config_file)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, action="append")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mixture-bench"))
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    from mixture_bench import build, config_of  # beside this file: its stores

    roots = [root.resolve() for root in args.root or [HERE.parent]]
    configs = {}
    for k in sorted(args.sources):
        configs[k] = args.dir / f"start-k{k}.json"
        configs[k].write_text(json.dumps(config_of(build(args.dir, k, 1 << 24))))
    load = os.getloadavg()[0]
    got: dict[tuple[int, int], list[dict]] = {}
    for round_ in range(args.rounds):  # the checkouts' order alternates between rounds
        for r in roots[:: 1 if round_ % 2 == 0 else -1]:
            for k, config_file in configs.items():
                got.setdefault((roots.index(r), k), []).append(child(r, config_file))
    print(f"load average at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}\n")
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
