"""Host throughput of `Plan.batch` and the cost of a far step (resume cost must not grow).

    python benchmarks/plan_bench.py [--store /tmp/bench-code] [--reps 7]

Prepares `builtin:python-code` into the store directory if it is missing. For a few
(seq_len, batch, lanes, processes) shapes it times one host's rows of `Plan.batch` near step 0
and near step 10**9 (median of repetitions, steps 997 apart), and the index computation alone
(`draws`), and prints host tokens/s and the far/near time ratio. The last shape has more
windows per lane than `layout.SMALL_DOMAIN`, so its window orders are computed per draw, not
cached per (epoch, lane).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipeline.config import parse_config
from pipeline.plan.rows import host_rows
from pipeline.read.plan import Plan
from pipeline.store.token_store import is_store

SHAPES = [  # seq_len, global batch, lanes, processes
    (256, 16, 4, 1),
    (1024, 64, 8, 4),
    (2048, 256, 16, 16),
    (64, 64, 1, 1),  # ~189k windows per lane: every draw's window computed on its own
]


def ensure_store(path: Path) -> None:
    if is_store(path):
        return
    print(f"preparing builtin:python-code -> {path}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", "builtin:python-code", "--out", str(path),
         "--no-progress"],
        check=True,
    )  # fmt: skip


def median_seconds(plan: Plan, first_step: int, rows, reps: int, what: str = "batch") -> float:
    call = plan.batch if what == "batch" else plan.draws
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        call(first_step + rep * 997, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("/tmp/bench-code"))
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    ensure_store(args.store)
    header = (
        f"{'seq_len':>7} {'batch':>5} {'lanes':>5} {'procs':>5} {'host rows':>9} "
        f"{'step 0 ms':>10} {'host tok/s':>12} {'step 1e9 ms':>11} {'1e9/0 ratio':>11} "
        f"{'draws 0 ms':>10} {'draws 1e9 ms':>12}"
    )
    print(header)
    print("-" * len(header))
    for seq_len, batch, lanes, processes in SHAPES:
        raw = {
            "seed": 1,
            "seq_len": seq_len,
            "global_batch_size": batch,
            "lanes": lanes,
            "sources": {"code": {"path": str(args.store)}},
            "mix": {"code": 1},
        }
        plan = Plan.from_config(parse_config(raw, origin="plan_bench"))
        rows = host_rows(batch, 0, processes)
        plan.batch(0, rows)  # open shards once
        near = median_seconds(plan, 1, rows, args.reps)
        far = median_seconds(plan, 10**9, rows, args.reps)
        near_draws = median_seconds(plan, 1, rows, args.reps, "draws")
        far_draws = median_seconds(plan, 10**9, rows, args.reps, "draws")
        tokens = len(rows) * seq_len
        print(
            f"{seq_len:>7} {batch:>5} {lanes:>5} {processes:>5} {len(rows):>9} "
            f"{near * 1e3:>10.2f} {tokens / near:>12,.0f} {far * 1e3:>11.2f} {far / near:>11.2f} "
            f"{near_draws * 1e3:>10.2f} {far_draws * 1e3:>12.2f}"
        )


if __name__ == "__main__":
    main()
