"""`pipeline bench`: the path users run (DataFeed -> global arrays) against Grain's best.

    python -m pipeline bench                       # synthetic uint32 store, ~700-token documents
    python -m pipeline bench --store python-code   # builtin:python-code, prepared once
    python -m pipeline bench --store mixture       # python-code + python-tests + python-docs
    python benchmarks/bench.py --store /path/to/store --rows 32 --seq-len 2048

On one store (or mixture) and one global batch (rows x seq_len tokens, packed, no padding),
each contender runs in its own OS process with `--devices` simulated CPU devices
(benchmarks/contenders.py). Rounds are interleaved (each round runs every contender in turn,
for at least `--steps` batches and `--round-s` seconds, the order rotated every round);
figures are medians over rounds:

* ours: `DataFeed(config, mesh)` -> the six global `jax.Array`s (the headline row; also with
  `stats=False`, the A/B of the feed statistics' cost, docs/observability.md, and with
  `feed: {verify: off}`, the A/B of the block checksums' cost, docs/token-store.md, which the
  report's "checksummed reads" line also times alone); the MaxText adapter's iterator
  (`create_data_iterator`); the Grain view of the same plan
  (`host_dataset(plan).batch(rows).to_iter_dataset().mp_prefetch(2 workers)` -> the same
  global arrays: what the Grain path costs); `Plan.batch` alone, through the flat sidecars
  and through ArrayRecord records (host work only, no devices);
* Grain, what a MaxText user runs: ArrayRecordDataSource -> shuffle -> repeat -> [mix] ->
  decode -> to_iter_dataset(ReadOptions) -> ConcatThenSplit -> batch -> the six fields ->
  [mp_prefetch] -> `make_array_from_process_local_data`, for every ReadOptions in
  GRAIN_READ_OPTIONS (num_threads=0 included) and for mp_prefetch with 1..cores workers;
* limits (host only): ArrayRecord reading exactly the records our batches need, batched and
  per record; `np.copyto` of the batch's bytes;
* the transfer limit, in its own worker: the feed's transfer call alone, per step, on fresh
  copies of one step's six fields (read before the clock starts): what every contender ending
  in these global arrays pays, Grain's rows too; and the same for the compact form (tokens +
  boundaries, `pipeline.read.compact`), alone and with the on-device expansion
  (`pipeline.feed.expand`), next to DataFeed with `feed: {expand: device}`.

Per contender: tokens/s; CPU seconds per million tokens (the worker process and its children,
all the work it did from its first timed round to the end of its last, background prefetch
included); the time the consumer thread spends inside `next()` per step when a simulated
training step of `--pace-ms` keeps the prefetch ahead. Then the documented restore path to the
first global batch at steps 0, 10^3, 10^6, 10^9 (ours and Grain's best single-process
setting; ours also at 10^6 with 10,000 `set_mix` calls in the ledger), and ours and the
transfer limits (six fields; tokens + boundaries) in 1, 2 and 4 localhost `jax.distributed`
processes on the same global batch (CPU per token per process).
Last, the packed-SFT table (`sft_bench.py`, skipped with `--no-sft`, alone with `--sft-only`):
DataFeed of a best_fit source against Grain's first-fit and best-fit packers (and best-fit with
mp_prefetch), all ending in the global arrays, in workers of this file's `throughput`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sft_bench
from grain_read import fastest, grain_label, grain_settings, ratio
from store_cache import store_dir, usable

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "contenders.py"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pipeline-bench"
RESTORE_STEPS = (0, 10**3, 10**6, 10**9)
RESTORE_REPS = 3  # per step and contender, each after an untimed warm-up; median
MIX_CALLS = 10_000  # set_mix calls recorded in the ledger of the mixed restore row
MIX_STEP = 10**6  # the step it restores (a call every MIX_STEP // MIX_CALLS steps before it)
PACED_RUNS = 2  # of 10 steps each, for the next() timing; median
PREFIX = "bench-answer "  # contenders.PREFIX: the worker's answer lines
MIXTURE = {"python-code": 3, "python-tests": 2, "python-docs": 1}
SCALE_PROCESSES = (1, 2, 4)
GRAIN_VIEW_WORKERS = 2  # the Grain view's row: mp_prefetch as docs/jax-integration.md shows it
# the most a worker may take to answer one command (start, a round, a restore) before the
# bench gives up on it: far above a default round's seconds, so only a hung worker reaches it
ANSWER_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default="synthetic",
        help="synthetic (default: uint32 documents of ~700 tokens), python-code "
        "(builtin:python-code, prepared once), mixture (python-code, python-tests and "
        "python-docs weighted 3:2:1) or a token store directory",
    )
    parser.add_argument("--rows", type=int, default=32, help="global batch rows")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--lanes", type=int, default=1, help="the config's lanes")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=20, help="least batches per round")
    parser.add_argument(
        "--round-s", type=float, default=0.4, help="least seconds per contender per round"
    )
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=30.0,
        help="simulated training step for the next() timing (ms)",
    )
    parser.add_argument(
        "--grain-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="mp_prefetch with 1..N workers (default: the cores)",
    )
    parser.add_argument(
        "--synthetic-tokens", type=int, default=32_000_000, help="tokens of the synthetic store"
    )
    parser.add_argument("--synthetic-doc-len", type=int, default=700, help="mean tokens/doc")
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help="where stores are made")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-scale", action="store_true", help="skip the 1/2/4 process runs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    sft_bench.add_arguments(parser)


# -- stores ------------------------------------------------------------------------------------


def synthetic_store(
    path: Path,
    tokens: int,
    doc_len: int,
    shards: int = 8,
    seed: int = 0,
    vocab_size: int = 100_277,
) -> None:
    """Documents with geometric lengths (mean `doc_len`), random ids below 50,257 (below
    `vocab_size` when smaller: scripts/device_check.py's model has a small vocabulary), the
    last the end of a document; uint32 for the default vocabulary, as for a 100k+ one."""
    from pipeline.store.writer import (
        commit,
        staging_dir,
        synthetic_tokenizer,
        token_dtype,
        write_manifest,
        write_shard,
    )

    rng = np.random.default_rng(seed)
    staging = staging_dir(path)
    eod = min(50_256, vocab_size - 1)
    dtype = token_dtype(vocab_size)
    infos = []
    for shard in range(shards):
        lengths = np.maximum(rng.geometric(1 / doc_len, size=2 * tokens // shards // doc_len), 2)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens // shards) + 1]
        data = rng.integers(0, eod, size=int(lengths.sum()), dtype=dtype)
        data[np.cumsum(lengths) - 1] = eod
        docs = np.split(data, np.cumsum(lengths)[:-1])
        infos.append(write_shard(staging, shard, shards, docs, dtype))
    tokenizer = synthetic_tokenizer(vocab_size=vocab_size, eod_id=eod)
    write_manifest(staging, infos, tokenizer, dtype, {"synthetic": True})
    commit(staging, path, overwrite=True)  # replaces a store of an older format


def builtin_store(name: str, cache: Path) -> Path:
    path = store_dir(cache) / name
    if not usable(path):
        from pipeline.ingest.prepare import PrepareOptions, prepare

        path.parent.mkdir(parents=True, exist_ok=True)
        prepare(PrepareOptions([f"builtin:{name}"], path, overwrite=True, progress=False))
    return path


def resolve_sources(args: argparse.Namespace) -> dict[str, tuple[Path, float]]:
    """name -> (store, weight) of the benchmarked data."""
    if args.store == "synthetic":
        name = f"synthetic-{args.synthetic_tokens}-{args.synthetic_doc_len}"
        path = store_dir(args.cache_dir) / name
        if not usable(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            synthetic_store(path, args.synthetic_tokens, args.synthetic_doc_len)
        return {"corpus": (path, 1)}
    if args.store == "python-code":
        return {"code": (builtin_store("python-code", args.cache_dir), 1)}
    if args.store == "mixture":
        return {
            name.split("-")[1]: (builtin_store(name, args.cache_dir), weight)
            for name, weight in MIXTURE.items()
        }
    return {"corpus": (Path(args.store), 1)}


def config_mapping(sources: dict[str, tuple[Path, float]], args: argparse.Namespace) -> dict:
    return {
        "seed": 1,
        "seq_len": args.seq_len,
        "global_batch_size": args.rows,
        "lanes": args.lanes,
        "sources": {name: {"path": str(path.resolve())} for name, (path, _) in sources.items()},
        "mix": {name: weight for name, (_, weight) in sources.items()},
    }


def docs_per_batch(sources: dict[str, tuple[Path, float]], args: argparse.Namespace) -> float:
    """Documents a batch of Grain's packed pipeline consumes on average (the mixture's mean)."""
    from pipeline.store.token_store import TokenStore

    total = sum(weight for _, weight in sources.values())
    mean = sum(
        weight / total * TokenStore(path).num_tokens / TokenStore(path).num_documents
        for path, weight in sources.values()
    )
    return args.rows * (args.seq_len + 1) / mean


# -- workers -----------------------------------------------------------------------------------


class Worker:
    """One contender process (benchmarks/contenders.py), driven one JSON line at a time."""

    def __init__(
        self, spec: dict[str, Any], tmp: Path, devices: int, name: str, root: Path = ROOT
    ) -> None:
        """`root`: the source checkout the worker imports `pipeline` from (an A/B's other
        version, benchmarks/mix_restore_ab.py)."""
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        # stdout is read in a thread, so that `receive` can give up on a hung worker
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"bench-{name}", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the worker exited

    def wait_ready(self) -> None:
        self.receive()

    def send(self, command: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The worker's next answer; an error if it exits first or gives none within
        ANSWER_TIMEOUT_S (a hung worker: a jax.distributed peer lost, a Grain worker stuck)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise RuntimeError(
                    f"bench worker {self.name} gave no answer in {ANSWER_TIMEOUT_S:g} s"
                ) from None
            if line is None:
                code = self.process.wait(timeout=60)
                raise RuntimeError(f"bench worker {self.name} exited with code {code}")
            if line.startswith(PREFIX):
                return json.loads(line.removeprefix(PREFIX))

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        self.send(command)
        return self.receive()


def close_all(workers: list[Worker]) -> None:
    """Ask every worker to quit, then wait: the processes of a jax.distributed job shut down
    together, so none may be waited for before all were asked."""
    for worker in workers:
        if worker.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                worker.send({"quit": True})
    for worker in workers:
        try:
            worker.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


def contender_table(args: argparse.Namespace) -> dict[str, tuple[str, dict]]:
    """name -> (worker kind, Grain options) of every throughput contender, in table order."""
    table: dict[str, tuple[str, dict]] = {
        "feed": ("feed", {}),
        "feed_nostats": ("feed_nostats", {}),
        "feed_unchecked": ("feed_unchecked", {}),
        "feed_device": ("feed_device", {}),
        "maxtext": ("maxtext", {}),
        "grain_view": ("grain_view", {"workers": GRAIN_VIEW_WORKERS}),
        "transfer": ("transfer", {}),
        "transfer_compact": ("transfer_compact", {}),
        "transfer_expanded": ("transfer_expanded", {}),
    }
    for suffix, options in grain_settings(args.grain_workers).items():
        table[f"grain_{suffix}"] = ("grain", options)
    return table


HOST_ONLY = ("plan", "plan_arrayrecord", "format_per_record", "format_batched", "copy")


def throughput(
    specs: dict[str, dict], host: dict | None, args: argparse.Namespace, tmp: Path, bar
) -> tuple[dict[str, dict], dict[str, Worker]]:
    """Interleaved rounds over every contender: one worker of `--devices` devices per spec
    (name -> its worker spec) and one worker of one device for the host-only contenders of
    `host`; returns per-contender medians and the workers (kept open for the restores)."""
    workers: dict[str, Worker] = {}
    try:
        return measure(workers, specs, host, args, tmp, bar), workers
    except BaseException:  # the caller gets no workers to close: close the ones started
        close_all(list(workers.values()))
        raise


def measure(
    workers: dict[str, Worker],
    specs: dict[str, dict],
    host: dict | None,
    args: argparse.Namespace,
    tmp: Path,
    bar,
) -> dict[str, dict]:
    """`throughput`'s rounds, starting its workers into `workers` as it goes."""
    for name, spec in specs.items():
        workers[name] = Worker(spec, tmp, args.devices, name)
    host_only = list(host["contenders"]) if host else []
    if host:
        workers["host"] = Worker(host, tmp, 1, "host")
    for worker in workers.values():
        worker.wait_ready()
        bar.update()
    order = list(specs) + host_only
    runs: dict[str, list[dict]] = {name: [] for name in order}
    paced: dict[str, list[dict]] = {name: [] for name in order}
    for rep in range(args.reps):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            worker = workers["host"] if name in host_only else workers[name]
            command = {"run": name, "steps": args.steps, "pace": 0.0, "seconds": args.round_s}
            runs[name].append(worker.ask(command))
        bar.update()
    for name in order:  # the training thread's share, with the prefetch ahead
        worker = workers["host"] if name in host_only else workers[name]
        for _ in range(PACED_RUNS):
            pace = args.pace_ms / 1e3
            paced[name].append(worker.ask({"run": name, "steps": 10, "pace": pace}))
    bar.update()
    return {name: summarise(runs[name], paced[name], name in host_only) for name in order}


def spent(run: dict) -> float:
    """CPU seconds of one run, its paused preparation left out."""
    return run["cpu_end"] - run["cpu_start"] - run["paused_cpu"]


def summarise(runs: list[dict], paced: list[dict], host_only: bool) -> dict[str, float]:
    """Medians over rounds; CPU from the first round's start to the last round's end for a
    worker of one contender (its background work between rounds included), per run for the
    host-only rows, which share a worker and have no background work; a limit's paused
    preparation (record lists, the transfer limit's copies) left out of both."""
    tokens = sum(r["tokens"] for r in runs)
    if host_only:
        cpu = sum(spent(r) for r in runs)
    else:
        cpu = runs[-1]["cpu_end"] - runs[0]["cpu_start"] - sum(r["paused_cpu"] for r in runs)
    return {
        "tokens": tokens,  # counted from the global arrays each run built
        "tokens_per_s": statistics.median(r["tokens"] / r["wall"] for r in runs),
        "cpu_s_per_mtok": cpu / tokens * 1e6,
        "next_ms_per_step": statistics.median(p["next"] / p["steps"] * 1e3 for p in paced),
        "next_cpu_ms_per_step": statistics.median(p["next_cpu"] / p["steps"] * 1e3 for p in paced),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


def restore_times(
    workers: dict[str, Worker], grain_best: str, args: argparse.Namespace, bar
) -> dict[str, dict]:
    """Median restore-to-first-global-batch per step, interleaved ours / Grain."""
    result: dict[str, dict] = {"feed": {}, grain_best: {}}
    for step in RESTORE_STEPS:
        samples: dict[str, list[dict]] = {name: [] for name in result}
        for _ in range(RESTORE_REPS):
            for name in result:
                samples[name].append(workers[name].ask({"restore": step, "name": name}))
        for name, times in samples.items():
            result[name][str(step)] = {
                key: statistics.median(t[key] for t in times) for key in times[0]
            }
        bar.update()
    return result


def mix_restore_times(feed: Worker, bar) -> dict[str, dict]:
    """Median restore-to-first-global-batch at MIX_STEP with 0 and MIX_CALLS `set_mix` calls
    in the ledger (interleaved), and the data state's bytes: the cost of adaptive mixtures'
    record (docs/mixtures.md, "Adaptive mixtures")."""
    samples: dict[int, list[dict]] = {0: [], MIX_CALLS: []}
    for _ in range(RESTORE_REPS):
        for calls, times in samples.items():
            times.append(feed.ask({"restore": MIX_STEP, "name": "feed", "mixes": calls}))
    bar.update()
    return {
        str(calls): {key: statistics.median(t[key] for t in times) for key in times[0]}
        for calls, times in samples.items()
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCALED = {"feed": "feed", "transfer": "transfer", "transfer_compact": "transfer_compact"}
"""The contenders of every scale process: DataFeed, the transfer of the six fields and of
tokens + boundaries (`feed: {expand: device}`'s transfer)."""


def cpu_per_mtok(runs: list[dict]) -> float:
    """Mean CPU seconds per million tokens per process of one run in every process."""
    return statistics.mean(spent(r) / r["tokens"] * 1e6 for r in runs)


def scale(base: dict, args: argparse.Namespace, tmp: Path, bar) -> dict[str, dict]:
    """DataFeed in 1, 2, 4 localhost processes on the same global batch (devices split),
    then the transfer limit in the same processes: the part no loader can shed. Each
    contender is closed after its run: the feed's readers would refill its prefetch beside
    the transfer's."""
    result = {}
    for processes in SCALE_PROCESSES:
        if args.devices % processes or args.rows % args.devices:
            continue
        port = free_port()
        workers: list[Worker] = []
        try:  # started inside it: a start that fails still closes the ones before it
            for i in range(processes):
                spec = dict(base, contenders=SCALED, processes=processes, process_id=i, port=port)
                workers.append(
                    Worker(spec, tmp, args.devices // processes, f"scale{processes}-{i}")
                )
            for worker in workers:
                worker.wait_ready()
            runs = {}
            for name in SCALED:  # the feed first: its peak RSS is its own
                for worker in workers:
                    worker.send({"run": name, "steps": args.steps * args.reps, "pace": 0.0})
                runs[name] = [worker.receive() for worker in workers]
                for worker in workers:
                    worker.ask({"close": name})
        finally:
            close_all(workers)
        feed = runs["feed"]
        result[str(processes)] = {
            "tokens_per_s_per_process": statistics.mean(r["tokens"] / r["wall"] for r in feed),
            "cpu_s_per_mtok_per_process": cpu_per_mtok(feed),
            "transfer_cpu_s_per_mtok_per_process": cpu_per_mtok(runs["transfer"]),
            "compact_cpu_s_per_mtok_per_process": cpu_per_mtok(runs["transfer_compact"]),
            "rows_per_process": args.rows // processes,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in feed),
        }
        bar.update()
    return result


def stats_call_seconds(config: dict, calls: int = 2000) -> float:
    """What the feed's statistics add to a step, timed alone on a real step's draws: the
    reader task's `StepRead.of` and `next()`'s `Recorder.served` (docs/observability.md)."""
    from pipeline.config import parse_config
    from pipeline.feed.stats import Recorder, StepRead
    from pipeline.read.plan import Plan

    plan = Plan.from_config(parse_config(config, origin="bench"))
    recorder = Recorder(0, prefetch=2, share=0.1, window=100, warn=False)
    draws = plan.draws(0, np.arange(config["global_batch_size"]))  # one read per step
    start = time.perf_counter()
    for step in range(calls):
        read = StepRead.of(plan, draws, time.perf_counter())
        recorder.served(step, read, time.perf_counter(), time.perf_counter(), ready=2)
    return (time.perf_counter() - start) / calls


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from pipeline.progress import progress_bar
    from pipeline.store.token_store import TokenStore

    sources = resolve_sources(args)
    stores = {name: TokenStore(path) for name, (path, _) in sources.items()}
    base = {
        "config": config_mapping(sources, args),
        "itemsize_dtype": next(iter(stores.values())).dtype.name,
        "docs_per_batch": docs_per_batch(sources, args),
    }
    contenders = contender_table(args)
    grain = {name: options for name, (kind, options) in contenders.items() if kind == "grain"}
    count = len(contenders) + 1
    phases = count + args.reps + 2 + len(RESTORE_STEPS) + (0 if args.no_scale else 3)
    bar = progress_bar(total=phases, desc="bench", unit=" phase", enabled=not args.no_progress)
    with tempfile.TemporaryDirectory() as tmp:
        base["tmp"] = tmp
        workers: dict[str, Worker] = {}
        try:
            specs = {
                name: dict(base, contenders={name: kind}, grain=options)
                for name, (kind, options) in contenders.items()
            }
            host = dict(base, contenders={name: name for name in HOST_ONLY})
            results, workers = throughput(specs, host, args, Path(tmp), bar)
            rates = {name: results[name]["tokens_per_s"] for name in grain}
            grain_best = fastest(rates, grain, mp=False)
            restore = restore_times(workers, grain_best, args, bar)
            mix_restore = mix_restore_times(workers["feed"], bar)
        finally:
            close_all(list(workers.values()))
        scaled = {} if args.no_scale else scale(base, args, Path(tmp), bar)
    tokens_per_step = args.rows * args.seq_len
    step_s = {
        "with": tokens_per_step / results["feed"]["tokens_per_s"],
        "without": tokens_per_step / results["feed_nostats"]["tokens_per_s"],
    }
    calls = stats_call_seconds(base["config"])
    overhead = {
        "step_s": step_s,
        "ab_overhead": step_s["with"] / step_s["without"] - 1,
        "stats_call_s": calls,
        "call_overhead": calls / step_s["without"],
    }
    bar.close()
    return {
        "store": args.store,
        "sources": {
            name: {
                "path": str(path),
                "weight": weight,
                "tokens": stores[name].num_tokens,
                "documents": stores[name].num_documents,
                "dtype": stores[name].dtype.name,
            }
            for name, (path, weight) in sources.items()
        },
        "rows": args.rows,
        "seq_len": args.seq_len,
        "lanes": args.lanes,
        "devices": args.devices,
        "steps": args.steps,
        "round_s": args.round_s,
        "reps": args.reps,
        "pace_ms": args.pace_ms,
        "cores": os.cpu_count(),
        "contenders": results,
        "grain": grain,  # name -> options of every Grain row
        "grain_best_single": grain_best,
        "grain_best_mp": fastest(rates, grain, mp=True),
        "restore_s": restore,
        "mix_restore_s": mix_restore,
        "scale": scaled,
        "stats_overhead": overhead,
        "checksum_cost": checksum_cost(results, base["config"], args.steps * args.reps, args.reps),
    }


def checksum_cost(c: dict[str, dict], config: dict, steps: int, rounds: int) -> dict[str, float]:
    """What the block checksums of checked reads (`feed: {verify: read}`, the default) cost, as
    shares of DataFeed's CPU per token: DataFeed against `verify: off` (interleaved workers, so
    with their noise), and `checked_reads_cpu`, the checks' work alone."""
    feed = c["feed"]["cpu_s_per_mtok"]
    alone = checked_reads_cpu(config, steps, rounds) * 1e6
    return {
        "feed_share": (feed - c["feed_unchecked"]["cpu_s_per_mtok"]) / feed,
        "plan_cpu_s_per_mtok": alone,
        "plan_share": alone / feed,
    }


def checked_reads_cpu(config: dict, steps: int, rounds: int) -> float:
    """CPU seconds per token that checked reads add to `Plan.batch` in this process: the median
    of `checked_reads_differences`."""
    return statistics.median(checked_reads_differences(config, steps, rounds))


def checked_reads_differences(config: dict, steps: int, rounds: int) -> list[float]:
    """Per round, the CPU seconds per token of `steps` steps read with `verify: read` less the
    same steps with `verify: off`, each from freshly opened stores (so every block the steps
    touch is checked inside the clock, as in a run's first epoch), back to back in alternating
    order. A pair shares the machine's load, which two series apart do not: on a loaded machine
    the difference of their medians swung by more than the cost."""
    from pipeline.config import parse_config
    from pipeline.read.plan import Plan

    rows = np.arange(config["global_batch_size"])
    differences = []
    for round_ in range(rounds):
        spent = {}
        for verify in ("read", "off") if round_ % 2 == 0 else ("off", "read"):
            raw = {**config, "feed": {**config.get("feed", {}), "verify": verify}}
            plan = Plan.from_config(parse_config(raw, origin="bench"))
            start = time.process_time()
            tokens = sum(plan.batch(step, rows)["inputs"].size for step in range(steps))
            spent[verify] = (time.process_time() - start) / tokens
            for store in plan.stores():
                store.close()
        differences.append(spent["read"] - spent["off"])
    return differences


LABELS = {
    "feed": "**ours: DataFeed -> global arrays**",
    "feed_nostats": "ours: DataFeed(stats=False)",
    "feed_unchecked": "ours: DataFeed, feed: {verify: off} (no block checksums)",
    "feed_device": "ours: DataFeed, feed: {expand: device} (the six fields built on the devices)",
    "maxtext": "ours: MaxText create_data_iterator",
    "grain_view": f"ours through Grain: host_dataset + mp_prefetch({GRAIN_VIEW_WORKERS} workers)",
    "plan": "ours: Plan.batch, host only (flat sidecar)",
    "plan_arrayrecord": "ours: Plan.batch, host only (ArrayRecord records)",
    "format_per_record": "limit: ArrayRecord read(i, i+1) of the needed records",
    "format_batched": "limit: ArrayRecord read(list) of the needed records",
    "copy": "limit: np.copyto of the batch's token bytes",
    "transfer": "limit: transfer of the six fields only",
    "transfer_compact": "limit: transfer of tokens + boundaries only",
    "transfer_expanded": "limit: transfer of tokens + boundaries, then the on-device expansion",
}


def label(name: str, grain: dict[str, dict]) -> str:
    """A row's name; a Grain row's from its options (`grain`: name -> options)."""
    return LABELS[name] if name in LABELS else grain_label(grain[name])


def table(result: dict) -> str:
    c, grain = result["contenders"], result["grain"]
    feed = c["feed"]
    described = ", ".join(
        f"{name} {s['tokens']:,} {s['dtype']} tokens / {s['documents']:,} docs"
        + (f" (weight {s['weight']})" if len(result["sources"]) > 1 else "")
        for name, s in result["sources"].items()
    )
    lines = [
        f"store {result['store']}: {described}; global batch {result['rows']} x "
        f"{result['seq_len']} tokens, lanes {result['lanes']}, {result['devices']} simulated CPU "
        f"devices, {result['cores']} cores; {result['reps']} interleaved rounds of at least "
        f"{result['steps']} batches and {result['round_s']:g} s per contender, medians; next() "
        f"timed with a {result['pace_ms']:g} ms simulated step",
        "",
        "| pipeline (one process) | tokens/s | DataFeed / this | CPU s per M tokens | "
        "this / DataFeed CPU | next() ms per step | next() thread CPU ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in c.items():
        lines.append(
            f"| {label(name, grain)} | {r['tokens_per_s']:,.0f} | "
            f"{feed['tokens_per_s'] / r['tokens_per_s']:.2f} | {r['cpu_s_per_mtok']:.4f} | "
            f"{ratio(r['cpu_s_per_mtok'], feed['cpu_s_per_mtok']):.2f} | "
            f"{r['next_ms_per_step']:.2f} | {r['next_cpu_ms_per_step']:.2f} |"
        )
    single, mp = c[result["grain_best_single"]], c.get(result["grain_best_mp"] or "")
    limit = max(c["format_per_record"]["tokens_per_s"], c["format_batched"]["tokens_per_s"])
    limit_cpu = min(c["format_per_record"]["cpu_s_per_mtok"], c["format_batched"]["cpu_s_per_mtok"])
    lines += [
        "",
        f"DataFeed / Grain's best single process ({label(result['grain_best_single'], grain)}): "
        f"{feed['tokens_per_s'] / single['tokens_per_s']:.1f}x tokens/s, "
        f"{ratio(single['cpu_s_per_mtok'], feed['cpu_s_per_mtok']):.1f}x less CPU per token",
    ]
    if mp:
        lines.append(
            f"DataFeed / Grain's best mp_prefetch ({label(result['grain_best_mp'], grain)}): "
            f"{feed['tokens_per_s'] / mp['tokens_per_s']:.1f}x tokens/s, "
            f"{ratio(mp['cpu_s_per_mtok'], feed['cpu_s_per_mtok']):.1f}x less CPU per token"
        )
    transfer = c["transfer"]["cpu_s_per_mtok"]
    lines.append(
        f"transfer limit: {transfer:.4f} CPU s per M tokens, "
        f"{ratio(transfer, feed['cpu_s_per_mtok']):.0%} of DataFeed's CPU per token; the most "
        "any loader ending in these arrays could reach against Grain's best single process: "
        f"{ratio(single['cpu_s_per_mtok'], transfer):.1f}x less CPU per token"
    )
    compact, expanded = c["transfer_compact"], c["transfer_expanded"]
    lines.append(
        f"transfer less (tokens + boundaries): {compact['cpu_s_per_mtok']:.4f} CPU s per M "
        f"tokens, {ratio(transfer, compact['cpu_s_per_mtok']):.1f}x less than the six fields; "
        f"with the on-device expansion {expanded['cpu_s_per_mtok']:.4f} "
        f"({ratio(transfer, expanded['cpu_s_per_mtok']):.2f}x less); DataFeed with "
        f"expand: device / the default (auto: host on CPU devices): "
        f"{c['feed_device']['tokens_per_s'] / feed['tokens_per_s']:.2f}x tokens/s, "
        f"{ratio(c['feed_device']['cpu_s_per_mtok'], feed['cpu_s_per_mtok']):.2f}x CPU per token"
    )
    lines.append(
        f"Plan.batch / ArrayRecord format limit: {c['plan']['tokens_per_s'] / limit:.0%} in "
        f"tokens/s, {ratio(limit_cpu, c['plan']['cpu_s_per_mtok']):.0%} in CPU per token; "
        f"Plan.batch with the sidecar / through ArrayRecord: "
        f"{c['plan']['tokens_per_s'] / c['plan_arrayrecord']['tokens_per_s']:.1f}x"
    )
    restore = result["restore_s"]
    steps = list(restore["feed"])
    lines += [
        "",
        "| restore to the first global batch | "
        + " | ".join(f"step {int(s):,}" for s in steps)
        + " | last / first |",
        "| --- |" + " ---: |" * (len(steps) + 1),
    ]
    names = {
        "feed": "ours: DataFeed + CheckpointManager.restore(DataRestore) + next()",
        result["grain_best_single"]: "Grain: iterator + set_state + next() + global arrays",
    }
    for name, text in names.items():
        totals = [restore[name][s]["total"] for s in steps]
        cells = " | ".join(f"{t * 1e3:.1f} ms" for t in totals)
        lines.append(f"| {text} | {cells} | {totals[-1] / totals[0]:.2f} |")
    first = restore["feed"][steps[0]]
    lines.append(
        f"ours at step 0: DataFeed(config, mesh) {first['construct'] * 1e3:.1f} ms, "
        f"Orbax restore {first['orbax_restore'] * 1e3:.1f} ms, first next() "
        f"{first['first_next'] * 1e3:.1f} ms"
    )
    none, mixed = result["mix_restore_s"]["0"], result["mix_restore_s"][str(MIX_CALLS)]
    lines.append(
        f"ours with {MIX_CALLS:,} set_mix calls in the ledger (one every "
        f"{MIX_STEP // MIX_CALLS} steps, restored at step {MIX_STEP:,}): "
        f"{mixed['total'] * 1e3:.1f} ms, {none['total'] * 1e3:.1f} ms without "
        f"({mixed['total'] / none['total']:.2f}x; target <= 2x); data state "
        f"{mixed['state_bytes'] / 1e3:,.0f} kB, {none['state_bytes'] / 1e3:,.1f} kB without "
        "(target <= 1 MB)"
    )
    if result["scale"]:
        first = result["scale"]["1"]
        base = first["cpu_s_per_mtok_per_process"]
        limit = first["transfer_cpu_s_per_mtok_per_process"]
        small = first["compact_cpu_s_per_mtok_per_process"]
        lines += [
            "",
            "| DataFeed, processes | rows per process | tokens/s per process | "
            "CPU s per M tokens per process | vs 1 process | peak RSS per process | "
            "limit: transfer only, CPU s per M tokens per process | vs 1 process | "
            "limit: transfer of tokens + boundaries, CPU s per M tokens per process | "
            "vs 1 process |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for processes, r in result["scale"].items():
            transfer = r["transfer_cpu_s_per_mtok_per_process"]
            packed = r["compact_cpu_s_per_mtok_per_process"]
            lines.append(
                f"| {processes} | {r['rows_per_process']} | "
                f"{r['tokens_per_s_per_process']:,.0f} | {r['cpu_s_per_mtok_per_process']:.4f} | "
                f"{ratio(r['cpu_s_per_mtok_per_process'], base):.2f} | {r['peak_rss_mb']:.0f} MB | "
                f"{transfer:.4f} | {ratio(transfer, limit):.2f} | "
                f"{packed:.4f} | {ratio(packed, small):.2f} |"
            )
    overhead, checks = result["stats_overhead"], result["checksum_cost"]
    lines += [
        "",
        f"checksummed reads (feed: {{verify: read}}, the default) against verify: off: "
        f"DataFeed {checks['feed_share']:+.1%} of its CPU per token (interleaved workers); the "
        f"checks alone (Plan.batch from fresh stores, in one process) "
        f"{checks['plan_cpu_s_per_mtok']:+.4f} CPU s per M tokens = "
        f"{checks['plan_share']:+.1%} of DataFeed's CPU per token; target <= 3 %",
        f"feed statistics: DataFeed step {overhead['step_s']['with'] * 1e3:.2f} ms with, "
        f"{overhead['step_s']['without'] * 1e3:.2f} ms without (interleaved rounds, medians: "
        f"{overhead['ab_overhead']:+.1%}); the statistics' calls alone "
        f"{overhead['stats_call_s'] * 1e6:.0f} us per step = {overhead['call_overhead']:.2%} "
        "of a step",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return report(parser.parse_args(argv))


def report(args: argparse.Namespace) -> int:
    result = {}
    if not args.sft_only:
        result = run(args)
        print(table(result))
    if not args.no_sft:
        result["sft"] = sft_bench.run_sft(args, throughput, close_all)
        print("\n" + sft_bench.sft_table(result["sft"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
