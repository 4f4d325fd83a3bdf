"""Scale: host RSS versus records, store open and first batch versus shards, per-host plan cost
versus process count.

    python benchmarks/scale_bench.py [--dir /tmp/scale-bench] [--quick]
    python benchmarks/scale_bench.py --gcs [--dir /tmp/scale-bench] [--gcs-shards 10 1000]
    python benchmarks/scale_bench.py --requests

`--requests` prints, for 1, 2, 256 and 4,096 processes, the requests a second that the
processes' watcher threads (pipeline.feed.watcher) send at steady state, for the whole job, to
Cloud Storage (a `gs://` store's identity re-check) and to JAX's coordinator (the poll of the
published stops, the stragglers' time to batch): each process's count per period, from
host_stop's own choice of who checks a store and of the poll period, and process 0's reads of
the figures until all are in (typically 2 a window; the worst from stragglers' schedule of
reads), summed over the processes.
Nothing is timed: the figures are the periods'; benchmarks/rpc_bench.py counts a real job's.

`--mixtures` plans one host of a 64- and a 4,096-host job (2 rows per host, seq_len 2,048) over
mixtures of 35 and 256 sources (`mixture_bench`'s stores: 8 shards each, 2^24 tokens in all;
8 lanes),
a fresh process reads the last host's rows of `--mixture-steps` consecutive steps from a
restored step and reports its memory (resident, anonymous), the shards it holds open, and the
requests the same stores in a bucket would get, as a `gs://` store is read from its sidecars'
64 KiB blocks (docs/big-mixtures.md): one ranged request per block read for the first time
(counted from the blocks the local store checks on their first read), 3 per shard first used
(its two indexes and its block checksums) and one per store opened (its manifest). Requests a
second for the whole job are these times the hosts, at 1 s a step: at a synchronized restart
every host's store opens and first step at once; in steady state the mean over the steps.
With a warm cache tier (`feed: {cache: ...}`) a restart asks each store's identity only (one
request a store a host) and reads the rest from the host's disk.

`--gcs` measures only the start from a `gs://` store: the 10- and 1,000-shard stores are
uploaded to a local Cloud Storage API server (gcp-storage-emulator, as in the tests) and read
back from there; each row ends with a new process's time to its first batch (the first open,
then the plan's open and batch) from the bucket and from the same store on local disk.

Stores are synthetic (uint16 tokens, one 4-token document per record) and are built once
under --dir. Each RSS and start-up figure comes from a fresh child process, so
nothing measured before leaks into it; RSS is the resident size (VmRSS) before opening the
store and after one read in every shard. --quick uses 10x smaller sizes (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from pipeline.config import parse_config
from pipeline.feed import host_stop, stragglers
from pipeline.plan.rows import host_rows
from pipeline.read.plan import Plan
from pipeline.store.token_store import TokenStore, is_store
from pipeline.store.writer import (
    commit,
    staging_dir,
    synthetic_tokenizer,
    write_manifest,
    write_shard,
)
from pipeline.urls import copy_file, location

ROOT = Path(__file__).resolve().parent.parent

DOC = 4  # tokens per document (= per record)
TOKENIZER = synthetic_tokenizer(vocab_size=1000, eod_id=999)


def build(path: Path, shards: int, records: int) -> Path:
    """A store of `shards` shards of `records` 4-token documents each (built once)."""
    if is_store(path):
        return path
    print(f"building {path} ({shards} shards x {records:,} records)", file=sys.stderr, flush=True)
    staging = staging_dir(path)
    dtype = np.dtype(np.uint16)
    doc = np.array([1, 2, 3, 999], dtype=dtype)
    infos = [
        write_shard(staging, s, shards, (doc for _ in range(records)), dtype) for s in range(shards)
    ]
    write_manifest(staging, infos, TOKENIZER, dtype, {"benchmark": "scale"})
    commit(staging, path, overwrite=False)
    return path


def child(argv: list[str]) -> dict:
    """Run one measurement in a fresh interpreter; returns its JSON line."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", *argv], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_mb() -> float:
    """Resident memory now (Linux), in MB; imports leave a peak that would hide the stores."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def measure_rss(store_path: str, max_open: int) -> dict:
    """Read one token of every shard (the plan reaches every shard over an epoch)."""
    before = rss_mb()
    store = TokenStore(store_path, max_open_shards=max_open)
    for shard in range(store.num_shards):
        store.read_shard_tokens(shard, 0, 1)
    return {"rss_mb": rss_mb(), "baseline_mb": before}


def measure_start(store_path: str) -> dict:
    """Open the store alone; then what a trainer does: plan (opening it) + one host's batch."""
    start = time.perf_counter()
    TokenStore(store_path).close()
    opened = time.perf_counter()
    TokenStore(store_path).close()  # again: without the first request's client set-up
    reopened = time.perf_counter()
    raw = {
        "seq_len": 64,
        "global_batch_size": 16,
        "lanes": 4,
        "sources": {"s": {"path": store_path}},
        "mix": {"s": 1},
    }
    plan = Plan.from_config(parse_config(raw, origin="scale.yaml"))
    plan.batch(0, host_rows(16, 0, 4))
    done = time.perf_counter()
    return {
        "open_s": opened - start,
        "reopen_s": reopened - opened,
        "first_batch_s": done - reopened,
    }


def cold_first_batch_ms(times: list[dict]) -> float:
    """Median time of a new process from nothing to its first host batch: the first open (with
    the client's set-up) and the plan's open and batch."""
    return statistics.median(t["open_s"] + t["first_batch_s"] for t in times) * 1e3


def gcs_start(directory: Path, reps: int, shard_counts: list[int]) -> None:
    """Open and first batch of `gs://` stores on a local emulator (one fresh process each), and
    a new process's time to its first batch from there and from the same store on local disk."""
    from tests.gcs_emulator import serving

    print("## Store open and first batch from gs:// (local emulator, 10 records per shard)")
    print(
        "shards | objects | first open (ms) | open again (ms) | plan + first host batch (ms) | "
        "cold to first batch: gs:// (ms) | local (ms)"
    )
    print("--- | --- | --- | --- | --- | --- | ---")
    with serving(bare=True) as bucket:
        for shards in shard_counts:
            store = build(directory / f"shards-{shards}", shards, 10)
            url = f"{bucket}/shards-{shards}"
            files = sorted(store.iterdir())
            for file in files:
                copy_file(file, location(url) / file.name)
            times = [child(["start", url]) for _ in range(reps)]
            local = [child(["start", str(store)]) for _ in range(reps)]
            opened, again, first = (
                statistics.median(t[key] for t in times) * 1e3
                for key in ("open_s", "reopen_s", "first_batch_s")
            )
            print(
                f"{shards:,} | {len(files):,} | {opened:.1f} | {again:.1f} | {first:.1f} | "
                f"{cold_first_batch_ms(times):.1f} | {cold_first_batch_ms(local):.1f}"
            )


def host_cost(store_path: str, processes: int, rows_per_host: int, reps: int) -> dict:
    """One process stands in for the last host of a `processes`-process slice."""
    batch = processes * rows_per_host
    raw = {
        "seq_len": 64,
        "global_batch_size": batch,
        "lanes": min(batch, 64),
        "sources": {"s": {"path": store_path}},
        "mix": {"s": 1},
    }
    plan = Plan.from_config(parse_config(raw, origin="scale.yaml"))
    rows = host_rows(batch, processes - 1, processes)
    plan.batch(0, rows)  # warm: shard readers open
    times = []
    for rep in range(reps):
        begin = time.perf_counter()
        plan.batch(1 + rep, rows)  # consecutive steps, as a training host runs them
        times.append(time.perf_counter() - begin)
    tracemalloc.start()
    plan.batch(10**6, rows)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"ms": statistics.median(times) * 1e3, "peak_kb": peak / 1024}


TYPICAL_READS = 2
"""Process 0's reads of a window's figures in practice: the one after publishing its own (the
other hosts, a step behind at most, have mostly not published theirs yet) and the first read
again, `READ_AGAIN_S[0]` later, which finds them all."""


def worst_reads() -> int:
    """Process 0's reads of one window's figures when a host never publishes: the one after
    publishing, then one at each of `Peers._settle`'s scheduled times (gaps from
    `READ_AGAIN_S[0]` doubling up to `READ_AGAIN_S[1]`) up to `WINDOW_WAIT_S`, when the window
    closes without the figure. The watcher reads at a scheduled time or later, never sooner, so
    a real window makes no more."""
    t, gap, reads = 0.0, stragglers.READ_AGAIN_S[0], 1
    while t < stragglers.WINDOW_WAIT_S:
        t = min(t + gap, stragglers.WINDOW_WAIT_S)
        gap = min(2 * gap, stragglers.READ_AGAIN_S[1])
        reads += 1
    return reads


def request_rates(
    processes: int, bucket_stores: int, feeds: int = 2, window_s: float = 100.0
) -> dict[str, float]:
    """Requests a second of the whole job's watchers at the default periods, with
    `bucket_stores` `gs://` stores (random fingerprints) open in `feeds` feeds per process (a
    training and an eval feed by default), each ending a stats window every `window_s` seconds
    (100 steps of 1 s): to Cloud Storage, each process asks about the stores `checks_remote`
    gives it every `STORE_CHECK_S`; to the coordinator, each process's one watcher polls the
    stops every `poll_period` for all its feeds (nothing in one process), and exchanges each
    feed's time to batch once a window, at most once a poll period: one RPC on every process
    (its figure; process 0's verdict comes with the stop poll), on process 0 the directory
    reads (of one value per process each) until every figure is in, `TYPICAL_READS` (`*_worst`:
    `worst_reads()`), and the verdict. `*_per_host` are the same before the check, the poll and
    the read were per job: every process checked every store, every feed polled every `POLL_S`,
    and every host read every host's figure once a window."""
    rng = np.random.default_rng(0)
    fingerprints = [f"{rng.integers(2**63):016x}" for _ in range(bucket_stores)]
    checks = sum(
        host_stop.checks_remote(fingerprint, process, processes)
        for process in range(processes)
        for fingerprint in fingerprints
    )
    shared = processes > 1
    period = host_stop.poll_period(host_stop.POLL_S, processes)
    windows = shared * feeds / max(window_s, period)  # a second, for the job
    typical, worst = TYPICAL_READS, worst_reads()
    return {
        "storage": checks / host_stop.STORE_CHECK_S,
        "coordinator": shared * processes / period,
        "stragglers": windows * (processes + typical + 1),
        "stragglers_worst": windows * (processes + worst + 1),
        "values_read": windows * processes * typical,
        "values_read_worst": windows * processes * worst,
        "storage_per_host": processes * bucket_stores / host_stop.STORE_CHECK_S,
        "coordinator_per_host": shared * feeds * processes / host_stop.POLL_S,
        "values_read_per_host": windows * processes * processes,
        "poll_s": period,
    }


def print_request_rates(bucket_stores: int = 4, feeds: int = 2) -> None:
    print(
        f"## Watchers' requests a second, whole job ({bucket_stores} gs:// stores, {feeds} feeds "
        "per process, a stats window every 100 s)"
    )
    print(
        "processes | Cloud Storage (req/s) | coordinator: stop polls (RPC/s) | coordinator: "
        f"time to batch (RPC/s; {TYPICAL_READS} reads a window, worst {worst_reads()}) | "
        "time-to-batch values read/s (worst) | poll period (s) | before: storage, stop polls, "
        "values read"
    )
    print("--- | --- | --- | --- | --- | --- | ---")
    for processes in (1, 2, 256, 4096):
        r = request_rates(processes, bucket_stores, feeds)
        print(
            f"{processes:,} | {r['storage']:g} | {r['coordinator']:g} | {r['stragglers']:.3g} "
            f"({r['stragglers_worst']:.3g}) | {r['values_read']:.3g} "
            f"({r['values_read_worst']:.3g}) | {r['poll_s']:g} | {r['storage_per_host']:g}, "
            f"{r['coordinator_per_host']:g}, {r['values_read_per_host']:.3g}"
        )


FIRST_USE_REQUESTS = 3  # a shard's first use from gs://: its two indexes, its block checksums
MIXTURE_HOSTS = (64, 4096)
MIXTURE_SOURCES = (35, 256)
MIXTURE_LANES = 8  # 256 stores of 2^16 tokens: 3 windows of 2,049 tokens a lane


def measure_host(sources: int, hosts: int, steps: int, directory: str) -> dict:
    """The last host of `hosts` reading its 2 rows a step of a `sources` mixture."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mixture_bench

    from pipeline.store import open_shards
    from pipeline.store.flat_blocks import FlatBlocks
    from pipeline.store.token_store import TokenStore

    counts = {"blocks": 0, "first_uses": 0}  # blocks: 64 KiB blocks read a first time
    read_blocks, open_locked = FlatBlocks.read, TokenStore._open_shard_locked

    def read(self, start, stop):
        counts["blocks"] += self.checked[
            start >> self.shift : ((stop - 1) >> self.shift) + 1
        ].count(0)
        return read_blocks(self, start, stop)

    def first_use(self, shard):
        counts["first_uses"] += not self._opened[shard]
        return open_locked(self, shard)

    FlatBlocks.read, TokenStore._open_shard_locked = read, first_use
    raw = mixture_bench.config_of(mixture_bench.build(Path(directory), sources, 1 << 24))
    batch = 2 * hosts
    raw.update(global_batch_size=batch, lanes=MIXTURE_LANES)
    anon = float(status("RssAnon:"))
    stores = {name: TokenStore(spec["path"]) for name, spec in raw["sources"].items()}
    plan = Plan.from_config(parse_config(raw, origin="scale.yaml"), stores)
    rows = host_rows(batch, hosts - 1, hosts)
    first = 10**6
    plan.batch(first, rows)
    restart = dict(counts)
    for step in range(first + 1, first + steps):
        plan.batch(step, rows)
    first_uses = FIRST_USE_REQUESTS * restart["first_uses"]
    return {
        "restart_requests": sources + restart["blocks"] + first_uses,
        "steady_requests": (
            counts["blocks"] - restart["blocks"]
            + FIRST_USE_REQUESTS * (counts["first_uses"] - restart["first_uses"])
        ) / (steps - 1),
        "open_shards": open_shards.pool().open_count(),
        "rss_mb": status("VmRSS:"),
        "anon_mb": status("RssAnon:") - anon,
    }  # fmt: skip


def status(key: str) -> float:
    """A /proc/self/status figure in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise OSError(f"no {key} in /proc/self/status")


def print_mixture_hosts(directory: Path, steps: int) -> None:
    print("## One host of a big job over a big mixture (planned; 2 rows a host, seq_len 2,048)")
    print(
        "sources | hosts | host RSS MB (anon growth) | shards open | gs:// requests a step, "
        "steady (job at 1 s a step, /s) | restart: host's first step (job's burst) | "
        "restart with a warm cache (job)"
    )
    print("--- | --- | --- | --- | --- | --- | ---")
    for sources in MIXTURE_SOURCES:
        for hosts in MIXTURE_HOSTS:
            r = child(["host", str(directory), str(sources), str(hosts), str(steps)])
            print(
                f"{sources} | {hosts:,} | {r['rss_mb']:.0f} ({r['anon_mb']:.1f}) | "
                f"{r['open_shards']} | {r['steady_requests']:.1f} "
                f"({r['steady_requests'] * hosts:,.0f}) | {r['restart_requests']:,} "
                f"({r['restart_requests'] * hosts:,}) | {sources} ({sources * hosts:,})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/scale-bench"))
    parser.add_argument("--quick", action="store_true", help="10x smaller stores")
    parser.add_argument("--gcs", action="store_true", help="only the start from gs:// stores")
    parser.add_argument(
        "--gcs-shards", type=int, nargs="+", default=[10, 1000], help="--gcs: the stores' shards"
    )
    parser.add_argument("--requests", action="store_true", help="only the request rates")
    parser.add_argument("--mixtures", action="store_true", help="only the big-mixture hosts")
    parser.add_argument("--mixture-steps", type=int, default=50)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests:
        print_request_rates()
        return
    if args.mixtures:
        print_mixture_hosts(args.dir, args.mixture_steps)
        return
    if args.child and args.child[0] == "host":
        sources, hosts, steps = (int(a) for a in args.child[2:])
        print(json.dumps(measure_host(sources, hosts, steps, args.child[1])))
        return
    if args.child:
        kind, store, *rest = args.child
        result = measure_rss(store, int(rest[0])) if kind == "rss" else measure_start(store)
        print(json.dumps(result))
        return
    if args.gcs:
        args.dir.mkdir(parents=True, exist_ok=True)
        gcs_start(args.dir, reps=3, shard_counts=args.gcs_shards)
        return
    scale = 10 if args.quick else 1
    args.dir.mkdir(parents=True, exist_ok=True)
    per_shard = 62_500 // scale

    print("## RSS versus records (62,500 records per shard; one read in every shard)")
    print("records | shards | max_open_shards | RSS before open (MB) | RSS after (MB)")
    print("--- | --- | --- | --- | ---")
    for records in (10**6 // scale, 10**7 // scale):
        shards = records // per_shard
        store = build(args.dir / f"records-{records}", shards, per_shard)
        for max_open in (8, shards):
            rss = child(["rss", str(store), str(max_open)])
            print(
                f"{records:,} | {shards} | {max_open} | {rss['baseline_mb']:.0f} | "
                f"{rss['rss_mb']:.0f}",
                flush=True,
            )

    shards = 10_000 // scale
    store = build(args.dir / f"shards-{shards}", shards, 10)
    for max_open in (256, shards):
        rss = child(["rss", str(store), str(max_open)])
        print(
            f"{shards * 10:,} | {shards:,} | {max_open:,} | {rss['baseline_mb']:.0f} | "
            f"{rss['rss_mb']:.0f}",
            flush=True,
        )

    print("\n## Store open and first batch versus shards (10 records per shard)")
    print("shards | open (ms) | plan (opens the store) + first host batch (ms)")
    print("--- | --- | ---")
    for shards in (10, 1000 // scale, 10_000 // scale):
        store = build(args.dir / f"shards-{shards}", shards, 10)
        times = [child(["start", str(store)]) for _ in range(3)]
        opened = statistics.median(t["open_s"] for t in times) * 1e3
        first = statistics.median(t["first_batch_s"] for t in times) * 1e3
        print(f"{shards:,} | {opened:.1f} | {first:.1f}", flush=True)

    print("\n## Per-host plan cost versus process count (2 rows per host, seq_len 64)")
    print("processes | global batch | one host's batch (ms) | its peak allocation (KB)")
    print("--- | --- | --- | ---")
    store = str(args.dir / f"records-{10**6 // scale}")
    for processes in (1, 16, 256, 4096):
        cost = host_cost(store, processes, 2, reps=25)
        print(f"{processes:,} | {2 * processes:,} | {cost['ms']:.2f} | {cost['peak_kb']:.0f}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `tests.gcs_emulator`: a script's own path is benchmarks/
    main()
