"""A/B of the restore with recorded `set_mix` calls (issue 27) between code versions.

    .venv/bin/python benchmarks/mix_restore_ab.py --store mixture --root /tmp/before --root .

The bench's "restore with 10,000 recorded calls" row (docs/benchmarks.md, "Adaptive
mixtures"), for several source checkouts at once: one bench worker per `--root` (its `pipeline`
first on PYTHONPATH; default: this checkout), each timing the documented restore path to the
first global batch at step `bench.MIX_STEP` from a checkpoint whose ledger records 0 and
`bench.MIX_CALLS` calls (`contenders.Feed.restore`, after an untimed warm-up). Every round asks
each (root, calls) once, in an order that rotates between rounds, so load on a shared machine
hits them alike. Prints medians (range) per root and calls, the ratio of the medians, and the
load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # benchmarks/bench.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--root", type=Path, action="append", help="source checkout (repeatable)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    roots = [r.resolve() for r in args.root or [bench.ROOT]]
    spec = {"config": bench.config_mapping(bench.resolve_sources(args), args)}
    cases = [(k, calls) for k in range(len(roots)) for calls in (0, bench.MIX_CALLS)]
    totals: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        workers = [
            bench.Worker(
                dict(spec, tmp=tmp, contenders={"feed": "feed"}),
                Path(tmp),
                args.devices,
                f"root{k}",
                root,
            )
            for k, root in enumerate(roots)
        ]
        try:
            for worker in workers:
                worker.wait_ready()
            for round_ in range(args.rounds):
                shift = round_ % len(cases)
                for k, calls in cases[shift:] + cases[:shift]:
                    command = {"restore": bench.MIX_STEP, "name": "feed", "mixes": calls}
                    totals[(k, calls)].append(workers[k].ask(command)["total"] * 1e3)
        finally:
            bench.close_all(workers)
    print(
        f"{args.store}, {args.rows} x {args.seq_len}, {args.devices} devices, restore at step "
        f"{bench.MIX_STEP:,}, {args.rounds} rounds, medians (range); load average "
        f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"| root | 0 calls, ms | {bench.MIX_CALLS:,} calls, ms | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for k, root in enumerate(roots):
        none, mixed = totals[(k, 0)], totals[(k, bench.MIX_CALLS)]
        cells = [f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})" for t in (none, mixed)]
        ratio = statistics.median(mixed) / statistics.median(none)
        print(f"| {root} | {cells[0]} | {cells[1]} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
