"""The coordinator RPCs each process of a real job makes at steady state, counted, not modelled.

    python benchmarks/rpc_bench.py [--processes 4] [--steps 400] [--pace 0.1]

Starts PROCESSES local JAX processes (CPU, `jax.distributed.initialize` on 127.0.0.1) that run
tests/multihost_worker.py's "rpcs" task at the default watcher periods (unless
`PIPELINE_STOP_*_S` are set): each replaces JAX's coordination client by a counting proxy, opens
a training feed and a second feed (stepped every other step, as an eval feed is) with a stats
window of 20 steps, and trains in lockstep with a PACE s sleep per step. Over the steady part
(after 20 warm-up steps) it prints, per process, the key-value calls a second: all of them, the
polls of the stop directory, the reads of the time-to-batch directory (process 0's alone), and
those made on the training thread (0 is the design), with the time inside the training feed's
`next()`. docs/benchmarks.md quotes a run next to scale_bench's computed 4,096-host figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINING_THREAD = "MainThread"


def summarize(result: dict) -> dict[str, float]:
    """A worker's counted calls (`tests.multihost_worker.rpcs`) over its steady part, per
    second, and its training feed's time inside `next()` (ms)."""
    from pipeline.feed.host_stop import PREFIX
    from pipeline.feed.stragglers import TIME_TO_BATCH

    seconds = result["end"] - result["start"]
    steady = [call for call in result["calls"] if result["start"] <= call[3] <= result["end"]]
    waits = sorted(1e3 * wait for wait in result["waits"])

    def rate(picked: list) -> float:
        return len(picked) / seconds

    return {
        "seconds": seconds,
        "rpcs": rate(steady),
        "stop_polls": rate([c for c in steady if c[0] == "key_value_dir_get" and c[1] == PREFIX]),
        "ttb_reads": rate(
            [c for c in steady if c[0] == "key_value_dir_get" and c[1].startswith(TIME_TO_BATCH)]
        ),
        "training_thread": len([c for c in steady if c[2] == TRAINING_THREAD]),
        "next_p50_ms": statistics.median(waits),
        "next_p99_ms": waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "next_max_ms": waits[-1],
    }


def run(directory: Path, processes: int, steps: int, warmup: int, pace: float) -> list[dict]:
    """Each process's summary of one job (see module)."""
    from tests.feedstores import two_stage_raw
    from tests.test_multihost import launch, worker_output

    raw = two_stage_raw(
        directory / "stores", global_batch_size=4 * processes, feed={"stats_window": 20}
    )
    task = {"kind": "rpcs", "steps": steps, "warmup": warmup, "pace": pace}
    codes = launch(directory, raw, [task], processes=processes, devices=1, timeout=600)
    if codes != [0] * processes:
        raise SystemExit(f"exit codes {codes}:\n{worker_output(directory)}")
    return [
        summarize(json.loads((directory / f"rpcs-{i}.json").read_text())) for i in range(processes)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--pace", type=float, default=0.1, help="seconds of simulated step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as tmp:
        rows = run(Path(tmp), args.processes, args.steps, 20, args.pace)
    print(
        "process | steady s | key-value RPC/s | stop polls/s | ttb directory reads/s | "
        "on the training thread | next() p50 / p99 / max ms"
    )
    print("--- | --- | --- | --- | --- | --- | ---")
    for index, r in enumerate(rows):
        print(
            f"{index} | {r['seconds']:.0f} | {r['rpcs']:.2f} | {r['stop_polls']:.2f} | "
            f"{r['ttb_reads']:.2f} | {r['training_thread']} | {r['next_p50_ms']:.2f} / "
            f"{r['next_p99_ms']:.2f} / {r['next_max_ms']:.2f}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `tests.*`: a script's own path is benchmarks/
    main()
