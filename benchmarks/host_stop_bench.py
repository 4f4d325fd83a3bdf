"""What the cross-host stop (pipeline.feed.host_stop) costs a training step.

    .venv/bin/python benchmarks/host_stop_bench.py [--processes 2] [--calls 200000]

Starts PROCESSES local JAX processes (CPU, joined by `jax.distributed.initialize` on
127.0.0.1) that each open a feed over a small synthetic store and time, as medians:

* on the training thread, per `next()`: `HostStop.check()` and the `try` that publishes an
  error (the only work added to a step);
* in the watcher thread, per poll: the key-value directory read of the published stops (one
  RPC to the coordinator every `POLL_S`) and a store's identity check (`check_unchanged`, one
  `stat` every `STORE_CHECK_S`), with what they amount to per second.

docs/jax-integration.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(call, repeat: int) -> float:
    """Median seconds of `call()` over `repeat` batches of 100 calls each, per call."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(100):
            call()
        samples.append((time.perf_counter() - started) / 100)
    return statistics.median(samples)


def worker(spec: dict, index: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.errors import FeedError
    from pipeline.feed import host_stop
    from pipeline.feed.data_feed import DataFeed

    jax.distributed.initialize(f"127.0.0.1:{spec['port']}", spec["n"], index)
    config = parse_config(spec["config"], origin="bench.yaml")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with DataFeed(config, mesh) as feed:
        stop = feed._host_stop
        calls = spec["calls"] // 100

        def guarded() -> None:  # what __next__ adds around a step: the try and the check
            try:
                stop.check()
            except FeedError:
                raise

        client = host_stop.coordination_client()
        store = feed.plan.store(feed.plan.store_set.metas()[0])  # opened at its first draw
        result = {
            "check_ns": timed(stop.check, calls) * 1e9,
            "guarded_ns": timed(guarded, calls) * 1e9,
            "poll_us": timed(lambda: client.key_value_dir_get(host_stop.PREFIX), 20) * 1e6,
            "stat_us": timed(store.check_unchanged, 20) * 1e6,
        }
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    from pipeline.feed import host_stop
    from tests.storegen import write_synthetic_store

    with tempfile.TemporaryDirectory(prefix="host-stop-bench-") as tmp:
        store = Path(tmp) / "store"
        write_synthetic_store(store, [[40, 60, 50], [30, 70]], record_tokens=16)
        config = {"seed": 0, "seq_len": 8, "global_batch_size": 4 * args.processes,
                  "sources": {"s": {"path": str(store)}}, "mix": {"s": 1}}  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = {"port": port, "n": args.processes, "config": config, "calls": args.calls}
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        argv = [sys.executable, __file__, "--worker", json.dumps(spec)]
        procs = [
            subprocess.Popen([*argv, str(i)], env=env, stdout=subprocess.PIPE, text=True)
            for i in range(args.processes)
        ]
        results = [json.loads(p.communicate(timeout=600)[0].splitlines()[-1]) for p in procs]
    print("measured on | per step: check() | per step: try + check() | watcher: KV poll | "
          "watcher: store stat | watcher share of a second")  # fmt: skip
    print("--- | --- | --- | --- | --- | ---")
    poll, check, _ = host_stop.stop_periods()  # as the feed reads them
    for index, r in enumerate(results):
        share = r["poll_us"] / 1e6 / poll + r["stat_us"] / 1e6 / check
        print(
            f"process {index} of {args.processes} | {r['check_ns']:.0f} ns | "
            f"{r['guarded_ns']:.0f} ns | {r['poll_us']:.0f} µs every {poll:g} s | "
            f"{r['stat_us']:.1f} µs every {check:g} s | {share:.1e}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `tests.storegen`: a script's own path is benchmarks/
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
