"""Throughput, restore latency and memory of the JAX feed, in 1 and 2 localhost processes.

    python -m pipeline prepare builtin:python-code --out /tmp/bench-code
    python benchmarks/feed_bench.py --store /tmp/bench-code

Each configuration runs as separate processes (JAX_PLATFORMS=cpu, forced host devices) joined
with `jax.distributed.initialize` on 127.0.0.1. A process feeds `--steps` global batches to a
trivial jitted consumer, then times "restore to first batch": a fresh DataFeed at step 0 and at
step 10^6 (no replay: the step is an input of the plan). Peak RSS is `ru_maxrss` per process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed

    if args.processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    raw = {
        "seed": 0,
        "seq_len": args.seq_len,
        "global_batch_size": args.batch,
        "lanes": args.lanes,
        "sources": {"code": {"path": str(Path(args.store).resolve())}},
        "mix": {"code": 1},
    }
    config = parse_config(raw, origin="bench.yaml")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    consume = jax.jit(lambda b: (b["inputs"] * b["inputs_position"]).sum())
    result: dict[str, float] = {}
    with DataFeed(config, mesh, prefetch=args.prefetch, threads=args.threads) as feed:
        consume(next(feed)).block_until_ready()  # compile, warm the readers
        start = time.perf_counter()
        for _ in range(args.steps):
            out = consume(next(feed))
        out.block_until_ready()
        elapsed = time.perf_counter() - start
    result["steps_per_s"] = args.steps / elapsed
    result["tokens_per_s"] = args.steps * args.batch * args.seq_len / elapsed
    for step in (0, 10**6):  # best of 3: the restore path, not the page cache, is measured
        times = []
        for _ in range(3):
            start = time.perf_counter()
            with DataFeed(config, mesh, step=step) as feed:
                consume(next(feed)).block_until_ready()
            times.append(time.perf_counter() - start)
        result[f"first_batch_s_at_{step}"] = min(times)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out).write_text(json.dumps(result))
    if args.processes > 1:
        jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, processes: int, tmp: Path) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices // processes}"
    port = free_port()
    outs = [tmp / f"p{processes}-{i}.json" for i in range(processes)]
    common = [
        "--store", args.store, "--steps", str(args.steps), "--batch", str(args.batch),
        "--seq-len", str(args.seq_len), "--lanes", str(args.lanes),
        "--prefetch", str(args.prefetch), "--threads", str(args.threads),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *common,
                "--worker",
                "--processes",
                str(processes),
                "--process-id",
                str(i),
                "--port",
                str(port),
                "--out",
                str(outs[i]),
            ],
            env=env,
        )
        for i in range(processes)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
    if any(codes):
        raise SystemExit(f"benchmark workers failed with exit codes {codes}")
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a token store (pipeline prepare)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="total CPU devices per run")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes in (1, 2):
            results = run(args, processes, Path(tmp))
            rows.append((processes, results))
    print(
        f"store {args.store}, global batch {args.batch} x seq_len {args.seq_len}, "
        f"{args.devices} CPU devices, prefetch {args.prefetch}, threads {args.threads}, "
        f"{args.steps} steps"
    )
    header = ("processes", "steps/s", "tokens/s", "first batch @0 (s)", "@10^6 (s)", "ratio",
              "peak RSS/process (MB)")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for processes, results in rows:
        steps = min(r["steps_per_s"] for r in results)
        at0 = max(r["first_batch_s_at_0"] for r in results)
        far = max(r["first_batch_s_at_1000000"] for r in results)
        rss = max(r["peak_rss_mb"] for r in results)
        cells = (str(processes), f"{steps:.1f}", f"{steps * args.batch * args.seq_len:,.0f}",
                 f"{at0:.3f}", f"{far:.3f}", f"{far / at0:.2f}", f"{rss:.0f}")  # fmt: skip
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
