"""Big mixtures: DataFeed's per-step cost and resources against the number of sources.

    python benchmarks/mixture_bench.py [--sources 1 64 256 1024] [--rounds 3] [--steps 200]
        [--warmup 300] [--dir /tmp/mixture-bench] [--json FILE]

The headline is what a user runs: `DataFeed` to global arrays on 8 simulated CPU devices, 32
rows of 2,048 tokens a step (the shape of `pipeline bench`). A mixture of K sources is K stores
of 8 shards each, equally weighted, that together hold the same tokens whatever K (a corpus of
`--tokens` uint32 tokens cut into K stores), so every row is the same work and what changes
is only how many sources the rows come from. Each measurement is a fresh process (nothing
warm leaks between them), the mixtures interleaved round by round; medians over the rounds.

Per mixture: a restore's first batch in a fresh process (`DataFeed(config, mesh, step=10**6)`
to its first global batch: the stores' opening included; after a full garbage collection, so
that a collection the warm-up feed's garbage owes does not fall on it at random), then
`--steps` steps after a warm-up of `--warmup` steps (long enough for every shard's first use,
which a run pays once per shard, in its first epoch): wall and process CPU per step, the
threads, open file descriptors and mappings the process holds, and its resident memory (RSS,
and its anonymous and file-backed parts: the file part is the mapped pages of the sidecars
read, the page cache of what was served, bounded by the open shards; the anonymous part is
what the process itself allocates).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 8
EOD = 50_256


def build(directory: Path, sources: int, tokens: int) -> list[Path]:
    """`sources` stores of `SHARDS` shards that hold `tokens` uint32 tokens in all (built
    once): documents of 500 tokens, random ids, each store its own content."""
    from pipeline.store.token_store import is_store
    from pipeline.store.writer import (
        commit,
        staging_dir,
        synthetic_tokenizer,
        write_manifest,
        write_shard,
    )

    per_shard = tokens // sources // SHARDS
    paths = []
    for k in range(sources):
        path = directory / f"k{sources}" / f"s{k:04d}"
        paths.append(path)
        if is_store(path):
            continue
        rng = np.random.default_rng(k)
        staging = staging_dir(path)
        infos = []
        for shard in range(SHARDS):
            data = rng.integers(0, EOD, per_shard, dtype=np.uint32)
            cuts = np.arange(500, per_shard, 500)
            data[cuts - 1] = EOD
            data[-1] = EOD
            infos.append(write_shard(staging, shard, SHARDS, np.split(data, cuts), data.dtype))
        tokenizer = synthetic_tokenizer(vocab_size=100_277, eod_id=EOD)
        write_manifest(staging, infos, tokenizer, np.dtype(np.uint32), {"benchmark": "mixture"})
        commit(staging, path, overwrite=False)
    return paths


def config_of(paths: list[Path]) -> dict:
    return {
        "seed": 1,
        "seq_len": 2048,
        "global_batch_size": 32,
        "lanes": 1,
        "sources": {f"s{k:04d}": {"path": str(p)} for k, p in enumerate(paths)},
        "mix": {f"s{k:04d}": 1 for k in range(len(paths))},
    }


def status(key: str) -> float:
    """A /proc/self/status figure in MB (kB fields)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise OSError(f"no {key} in /proc/self/status")


def measure(raw: dict, steps: int, warmup: int) -> dict:
    """One mixture in this (fresh) process: a restore's first batch, then the steady steps."""
    import jax
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed
    from pipeline.store.open_shards import pool

    config = parse_config(raw, origin="mixture-bench")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with DataFeed(config, mesh, step=0) as warm:  # JAX's own first-call costs, not ours
        jax.block_until_ready(next(warm))
    anon = status("RssAnon:")
    gc.collect()  # the warm-up's garbage: its collection (40-60 ms) fell on the restore at random
    started = time.perf_counter()
    with DataFeed(config, mesh, step=10**6) as feed:
        jax.block_until_ready(next(feed))
        restore_s = time.perf_counter() - started
        for _ in range(warmup):  # every shard's first use (a fresh run's first epoch) done
            jax.block_until_ready(next(feed))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(next(feed))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return {
            "restore_first_batch_s": restore_s,
            "ms_per_step": wall / steps * 1e3,
            "cpu_ms_per_step": cpu / steps * 1e3,
            "threads": len(os.listdir("/proc/self/task")),
            "shard_bound": pool().limit,
            "open_shards": pool().open_count(),
            "open_files": len(os.listdir("/proc/self/fd")),
            "mappings": sum(1 for _ in open("/proc/self/maps")),
            "rss_mb": status("VmRSS:"),
            "rss_anon_mb": status("RssAnon:"),
            "rss_file_mb": status("RssFile:"),
            "anon_growth_mb": status("RssAnon:") - anon,
        }


def child(config: Path, steps: int, warmup: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(config), str(steps), str(warmup)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[int, list[dict]]) -> str:
    base = {key: statistics.median(r[key] for r in results[min(results)]) for key in results[1][0]}
    lines = [
        "sources | ms per step (x 1 source) | CPU ms per step (x) | restore + first batch, s (x) "
        "| threads | open shards (bound) | open files | mappings | RSS MB | anon MB | file MB",
        "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for sources, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        lines.append(
            f"{sources:,} | {m['ms_per_step']:.2f} ({m['ms_per_step'] / base['ms_per_step']:.2f}) "
            f"| {m['cpu_ms_per_step']:.2f} ({m['cpu_ms_per_step'] / base['cpu_ms_per_step']:.2f}) "
            f"| {m['restore_first_batch_s']:.3f} "
            f"({m['restore_first_batch_s'] / base['restore_first_batch_s']:.1f}) "
            f"| {m['threads']:.0f} | {m['open_shards']:,.0f} ({m['shard_bound']:,.0f}) "
            f"| {m['open_files']:,.0f} | {m['mappings']:,.0f} "
            f"| {m['rss_mb']:.0f} | {m['rss_anon_mb']:.0f} | {m['rss_file_mb']:.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--tokens", type=int, default=1 << 24, help="of each mixture in all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mixture-bench"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--warmup", type=int, default=300, help="steps before the measured")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        config, steps, warmup = args.child
        print(json.dumps(measure(json.loads(Path(config).read_text()), int(steps), int(warmup))))
        return
    configs = {}
    for k in sorted(args.sources):
        configs[k] = args.dir / f"k{k}.json"
        configs[k].write_text(json.dumps(config_of(build(args.dir, k, args.tokens))))
    if 1 not in configs:
        parser.error("--sources needs 1: the ratios are against one source")
    load = os.getloadavg()
    results: dict[int, list[dict]] = {k: [] for k in configs}
    for _ in range(args.rounds):  # interleaved: the machine's load moves every mixture alike
        for sources, config in configs.items():
            results[sources].append(child(config, args.steps, args.warmup))
    print(f"## Mixtures of 1 to {max(configs):,} sources ({args.tokens:,} tokens in all)")
    print(f"load average at the start {load[0]:.1f}, at the end {os.getloadavg()[0]:.1f}\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
