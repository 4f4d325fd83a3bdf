"""`pipeline bench`: our host reading path against Grain's packed pipeline and the hard limits.

    python -m pipeline bench                       # synthetic uint32 store, ~700-token documents
    python -m pipeline bench --store python-code   # builtin:python-code, prepared once
    python benchmarks/bench.py --store /path/to/store --rows 32 --seq-len 2048

On one store and one batch shape (rows x (seq_len + 1) tokens, packed, no padding), interleaved
and repeated (medians), in one process each:

* ours: `Plan.batch(step, rows)`, the path the feed's reader threads run (no devices);
* Grain: what a MaxText user runs today: `ArrayRecordDataSource` (records are our documents,
  bytes -> tokens) -> `MapDataset.source().shuffle(seed).repeat()` -> `.map(decode)` ->
  `.to_iter_dataset(ReadOptions)` -> `ConcatThenSplitIterDataset` (packing to seq_len + 1) ->
  `.batch(rows)`, with the best of a few ReadOptions;
* format limit: ArrayRecord reading exactly the records our batches need and nothing else,
  batched (`read(list)` per shard) and per record (`read(i, i + 1)`); the faster is the limit;
* copy limit: `np.copyto` of the same number of token bytes.

Then resume (restore to first batch at steps 0, 10^3, 10^6) for ours (a fresh `Plan` from the
ledger + `batch(step)`) and Grain (`set_state` on a fresh iterator: the state of step k is
built from a real `get_state()` template with `parent_state.next_index` set to the documents k
batches consume on average: Grain's iterator state is that index plus the packer's remainder),
and scale: ours in 1 and 2 concurrent OS processes (each its half of the rows), with peak RSS.

Last, the cost of the feed's statistics (`DataFeed.stats()`, docs/observability.md): the
`DataFeed` to global arrays on one CPU device with and without them, interleaved (best of the
repetitions), and the statistics' own calls per step (`ChunkRead.of` + `Recorder.served`) timed
alone, as a share of the feed's step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

RESUME_STEPS = (0, 10**3, 10**6)
GRAIN_OPTIONS = ((1, 16), (2, 64), (16, 500))  # (num_threads, prefetch_buffer_size); last: default
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pipeline-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default="synthetic",
        help="synthetic (default: uint32 documents of ~700 tokens), python-code "
        "(builtin:python-code, prepared once) or a token store directory",
    )
    parser.add_argument("--rows", type=int, default=32, help="rows per batch (one host)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="batches per timed repetition")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (median)")
    parser.add_argument("--synthetic-tokens", type=int, default=32_000_000)
    parser.add_argument("--synthetic-doc-len", type=int, default=700, help="mean tokens/doc")
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help="where stores are made")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-scale", action="store_true", help="skip the 1 vs 2 process runs")
    parser.add_argument("--no-progress", action="store_true")


# -- stores ------------------------------------------------------------------------------------


def synthetic_store(path: Path, tokens: int, doc_len: int, shards: int = 8, seed: int = 0) -> None:
    """uint32 documents with geometric lengths (mean `doc_len`), random ids below 50,257."""
    from pipeline.store.writer import commit, staging_dir, write_manifest, write_shard

    rng = np.random.default_rng(seed)
    staging = staging_dir(path)
    eod = 50_256
    infos = []
    for shard in range(shards):
        lengths = np.maximum(rng.geometric(1 / doc_len, size=2 * tokens // shards // doc_len), 2)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens // shards) + 1]
        data = rng.integers(0, eod, size=int(lengths.sum()), dtype=np.uint32)
        data[np.cumsum(lengths) - 1] = eod
        docs = np.split(data, np.cumsum(lengths)[:-1])
        infos.append(write_shard(staging, shard, shards, docs, np.dtype(np.uint32)))
    # vocab above 2**16 keeps the dtype uint32, as for a 100k+ vocabulary
    tokenizer = {"name": "synthetic", "spec": "synthetic", "vocab_size": 100_277, "eod_id": eod}
    write_manifest(staging, infos, tokenizer, np.dtype(np.uint32), {"synthetic": True})
    commit(staging, path, overwrite=True)  # replaces a store of an older format


def resolve_store(args: argparse.Namespace) -> Path:
    from pipeline.store.token_store import is_store

    if args.store == "synthetic":
        path = args.cache_dir / f"synthetic-{args.synthetic_tokens}-{args.synthetic_doc_len}"
        if not is_store(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            synthetic_store(path, args.synthetic_tokens, args.synthetic_doc_len)
        return path
    if args.store == "python-code":
        path = args.cache_dir / "python-code"
        if not is_store(path):
            from pipeline.store.prepare import PrepareOptions, prepare

            path.parent.mkdir(parents=True, exist_ok=True)
            options = PrepareOptions(["builtin:python-code"], path, overwrite=True, progress=False)
            prepare(options)
        return path
    return Path(args.store)


def make_plan(store: Path, args: argparse.Namespace):
    from pipeline.config import parse_config
    from pipeline.plan.plan import Plan

    raw = {
        "seed": 1,
        "seq_len": args.seq_len,
        "global_batch_size": args.rows,
        "lanes": args.lanes,
        "sources": {"corpus": {"path": str(store.resolve())}},
        "mix": {"corpus": 1},
    }
    return Plan.from_config(parse_config(raw, origin="bench"))


# -- contenders ----------------------------------------------------------------------------------


class Ours:
    """`Plan.batch` over consecutive steps of one host's rows."""

    def __init__(self, plan, rows: np.ndarray) -> None:
        self.plan, self.rows, self.step, self.tokens = plan, rows, 0, 0

    def batches(self, n: int) -> None:
        for _ in range(n):
            batch = self.plan.batch(self.step, self.rows)
            self.step += 1
            self.tokens += batch["inputs"].size + len(self.rows)  # windows of seq_len + 1


def grain_dataset(store, args: argparse.Namespace, threads: int, buffer: int):
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    dtype = store.dtype

    def decode(record: bytes) -> dict[str, np.ndarray]:
        return {"tokens": np.frombuffer(record, dtype=dtype).astype(np.int32)}

    files = [str(store.shard_file(s)) for s in range(store.num_shards)]
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=buffer)
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
    ds = ds.shuffle(seed=1).repeat().map(decode).to_iter_dataset(options)
    ds = ConcatThenSplitIterDataset(ds, length_struct={"tokens": args.seq_len + 1})
    return ds.batch(args.rows)


class Grain:
    def __init__(self, dataset) -> None:
        self.dataset, self.iterator, self.tokens = dataset, iter(dataset), 0

    def batches(self, n: int) -> None:
        for _ in range(n):
            self.tokens += next(self.iterator)["tokens"].size


class FormatLimit:
    """ArrayRecord reads of exactly the records `Ours` needs for the same steps, nothing else."""

    def __init__(self, plan, rows: np.ndarray, batched: bool) -> None:
        from array_record.python.array_record_module import ArrayRecordReader

        from pipeline.store.token_store import READER_OPTIONS

        self.plan, self.rows, self.batched, self.step, self.tokens = plan, rows, batched, 0, 0
        layout = next(iter(plan.segment_plan(0).layouts.values()))
        self.layout, self.store = layout, plan.store(layout.meta)
        self.readers = [
            ArrayRecordReader(str(self.store.shard_file(s)), READER_OPTIONS)
            for s in range(self.store.num_shards)
        ]

    def records(self, step: int) -> dict[int, list[int]]:
        draws = self.plan.draws(step, self.rows)
        needed: dict[int, set[int]] = {}
        for epoch, start in zip(draws.epoch.tolist(), draws.start.tolist()):
            for shard, lo, hi in self.layout.pieces(epoch, start, start + self.layout.seq_len + 1):
                offsets = self.store.record_offsets(shard)
                first = int(np.searchsorted(offsets, lo, side="right")) - 1
                last = int(np.searchsorted(offsets, hi, side="left"))
                needed.setdefault(shard, set()).update(range(first, last))
        return {shard: sorted(records) for shard, records in needed.items()}

    def batches(self, n: int) -> float:
        """Seconds spent reading (the record lists are computed outside the clock)."""
        plans = [self.records(self.step + i) for i in range(n)]
        self.step += n
        start = time.perf_counter()
        for needed in plans:
            for shard, records in needed.items():
                reader = self.readers[shard]
                if self.batched:
                    reader.read(records)
                else:
                    for record in records:
                        reader.read(record, record + 1)
        elapsed = time.perf_counter() - start
        self.tokens += n * len(self.rows) * (self.layout.seq_len + 1)
        return elapsed


class CopyLimit:
    """np.copyto of as many token bytes as `n` batches hold, from one large buffer to another."""

    def __init__(self, rows: int, width: int, itemsize: int, steps: int) -> None:
        self.per_batch = rows * width
        self.dtype = np.dtype(f"u{itemsize}")
        self.src = np.ones(self.per_batch * steps, self.dtype)
        self.dst = np.empty_like(self.src)
        self.tokens = 0

    def batches(self, n: int) -> float:
        size = self.per_batch * n
        if size > self.src.size:
            self.src = np.ones(size, self.dtype)
            self.dst = np.empty_like(self.src)
        start = time.perf_counter()
        np.copyto(self.dst[:size], self.src[:size])
        elapsed = time.perf_counter() - start
        self.tokens += size
        return elapsed


def timed(batches: Callable[[int], float | None], n: int) -> float:
    start = time.perf_counter()
    inner = batches(n)
    return inner if inner is not None else time.perf_counter() - start


# -- resume ----------------------------------------------------------------------------------------


def resume_ours(plan, rows: np.ndarray, step: int) -> float:
    from pipeline.plan.ledger import Ledger
    from pipeline.plan.plan import Plan

    state = json.loads(json.dumps(plan.ledger.to_json()))  # what a checkpoint holds
    start = time.perf_counter()
    fresh = Plan(Ledger.from_json(state), plan.stores())
    fresh.batch(step, rows)
    return time.perf_counter() - start


def grain_state_at(dataset, step: int, docs_per_batch: float) -> dict:
    """The state of Grain's iterator k batches in, built from a real state's structure."""
    template = iter(dataset).get_state()
    state = json.loads(json.dumps(template))
    state["parent_state"]["next_index"] = round(step * docs_per_batch)
    state["remainder_slices"] = template["remainder_slices"]  # keep the tuples
    return state


def resume_grain(dataset, state: dict) -> float:
    start = time.perf_counter()
    iterator = iter(dataset)
    iterator.set_state(state)
    next(iterator)
    return time.perf_counter() - start


# -- scale -------------------------------------------------------------------------------------


def scale_worker(args: argparse.Namespace) -> None:
    from pipeline.plan.plan import host_rows

    plan = make_plan(Path(args.worker_store), args)
    rows = host_rows(args.rows, args.process_id, args.processes)
    ours = Ours(plan, rows)
    ours.batches(1)
    start = time.perf_counter()
    ours.batches(args.steps * args.reps)
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.reps * len(rows) * (args.seq_len + 1)
    result = {
        "tokens_per_s": tokens / elapsed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.worker_out).write_text(json.dumps(result))


def run_scale(store: Path, args: argparse.Namespace, processes: int) -> list[dict]:
    common = ["--rows", str(args.rows), "--seq-len", str(args.seq_len),
              "--lanes", str(args.lanes), "--steps", str(args.steps), "--reps", str(args.reps),
              "--worker-store", str(store), "--processes", str(processes)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{i}.json" for i in range(processes)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *common,
                    "--process-id",
                    str(i),
                    "--worker-out",
                    str(outs[i]),
                ]
            )
            for i in range(processes)
        ]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"scale workers failed with exit codes {codes}")
        return [json.loads(out.read_text()) for out in outs]


# -- feed statistics overhead -----------------------------------------------------------------


class Feed:
    """`DataFeed` to a global array per field on one CPU device, with or without statistics."""

    def __init__(self, plan, stats: bool) -> None:
        import jax
        from jax.sharding import Mesh

        from pipeline.feed.data_feed import DataFeed

        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        self.feed = DataFeed(plan, mesh, log_events=False, stats=stats)
        self.tokens = 0

    def batches(self, n: int) -> None:
        import jax

        for _ in range(n):
            batch = next(self.feed)
            self.tokens += batch["inputs"].size
        jax.block_until_ready(batch)


def stats_call_seconds(plan, rows: np.ndarray, calls: int = 2000) -> float:
    """What the statistics add to one step, timed alone on a real step's draws."""
    from pipeline.feed.stats import ChunkRead, Recorder

    recorder = Recorder(0, prefetch=2, share=0.1, window=100, warn=False)
    parts = np.array_split(rows, min(plan.config.feed.threads, len(rows)))  # the feed's chunks
    chunks = [plan.draws(0, part) for part in parts]
    start = time.perf_counter()
    for step in range(calls):
        reads = [ChunkRead.of(plan, draws, time.perf_counter()) for draws in chunks]
        recorder.served(step, reads, time.perf_counter(), time.perf_counter(), ready=2)
    return (time.perf_counter() - start) / calls


def stats_overhead(plan, rows: np.ndarray, args: argparse.Namespace, bar) -> dict:
    feeds = {"with": Feed(plan, stats=True), "without": Feed(plan, stats=False)}
    for feed in feeds.values():
        feed.batches(2)  # start the readers, compile nothing twice
    seconds: dict[str, list[float]] = {name: [] for name in feeds}
    for rep in range(args.reps):
        for name in sorted(feeds, reverse=rep % 2 == 1):  # alternate which goes first
            seconds[name].append(timed(feeds[name].batches, args.steps))
        bar.update()
    for feed in feeds.values():
        feed.feed.close()
    # best of the repetitions: a busy machine only ever adds time, to either side
    step = {name: min(times) / args.steps for name, times in seconds.items()}
    calls = stats_call_seconds(plan, rows)
    return {
        "step_s": step,
        "ab_overhead": step["with"] / step["without"] - 1,
        "stats_call_s": calls,
        "call_overhead": calls / step["without"],
    }


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from pipeline.plan.plan import host_rows
    from pipeline.progress import progress_bar

    store_path = resolve_store(args)
    plan = make_plan(store_path, args)
    store = plan.stores()[0]
    rows = host_rows(args.rows, 0, 1)
    width = args.seq_len + 1
    phases = len(GRAIN_OPTIONS) + 4 * args.reps + 2 * len(RESUME_STEPS) * args.reps
    phases += 0 if args.no_scale else 2
    phases += args.reps  # feed statistics overhead
    bar = progress_bar(total=phases, desc="bench", unit=" phase", enabled=not args.no_progress)

    # Grain's read options: a short trial of each, keep the fastest.
    trials = {}
    trial_batches = max(2, args.steps // 4)
    for threads, buffer in GRAIN_OPTIONS:
        trial = Grain(grain_dataset(store, args, threads, buffer))
        trial.batches(1)
        trials[(threads, buffer)] = timed(trial.batches, trial_batches)
        bar.update()
    best = min(trials, key=trials.get)

    contenders = {
        "ours": Ours(plan, rows),
        "grain": Grain(grain_dataset(store, args, *best)),
        "format_batched": FormatLimit(plan, rows, batched=True),
        "format_per_record": FormatLimit(plan, rows, batched=False),
    }
    copy = CopyLimit(args.rows, width, store.dtype.itemsize, args.steps)
    for contender in contenders.values():
        contender.batches(1)  # open files, start threads
    for contender in contenders.values():
        contender.tokens = 0
    seconds: dict[str, list[float]] = {name: [] for name in [*contenders, "copy"]}
    for _ in range(args.reps):
        for name, contender in contenders.items():
            seconds[name].append(timed(contender.batches, args.steps))
            bar.update()
        seconds["copy"].append(copy.batches(args.steps))
    tokens_per_rep = args.steps * args.rows * width
    median = {name: statistics.median(times) for name, times in seconds.items()}
    throughput = {name: tokens_per_rep / s for name, s in median.items()}

    # Resume: ours and Grain interleaved, per step.
    docs_per_batch = args.rows * width / (store.num_tokens / store.num_documents)
    grain_ds = contenders["grain"].dataset
    resume: dict[str, dict[int, float]] = {"ours": {}, "grain": {}}
    for step in RESUME_STEPS:
        state = grain_state_at(grain_ds, step, docs_per_batch)
        times: dict[str, list[float]] = {"ours": [], "grain": []}
        for _ in range(args.reps):
            times["ours"].append(resume_ours(plan, rows, step))
            bar.update()
            times["grain"].append(resume_grain(grain_ds, state))
            bar.update()
        for name in times:
            resume[name][step] = statistics.median(times[name])

    scale = {}
    if not args.no_scale:
        for processes in (1, 2):
            scale[processes] = run_scale(store_path, args, processes)
            bar.update()
    overhead = stats_overhead(plan, rows, args, bar)
    bar.close()

    return {
        "store": str(store_path),
        "store_tokens": store.num_tokens,
        "store_documents": store.num_documents,
        "dtype": store.dtype.name,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "lanes": args.lanes,
        "steps": args.steps,
        "reps": args.reps,
        "grain_options_tokens_per_s": {
            f"{t}:{b}": trial_batches * args.rows * width / s for (t, b), s in trials.items()
        },
        "grain_best": list(best),
        "tokens_per_s": throughput,
        "tokens_consumed": {
            name: c.tokens for name, c in contenders.items() if name in ("ours", "grain")
        },
        "resume_s": {name: {str(k): v for k, v in steps.items()} for name, steps in resume.items()},
        "scale": {str(k): v for k, v in scale.items()},
        "stats_overhead": overhead,
    }


def table(result: dict) -> str:
    tps = result["tokens_per_s"]
    width = result["seq_len"] + 1
    limit_name = max(("format_batched", "format_per_record"), key=lambda n: tps[n])
    lines = [
        f"store {result['store']} ({result['store_tokens']:,} {result['dtype']} tokens, "
        f"{result['store_documents']:,} documents, "
        f"{result['store_tokens'] / result['store_documents']:.0f} tokens/document); batch "
        f"{result['rows']} x {width} tokens, lanes {result['lanes']}; {result['reps']} "
        f"interleaved repetitions of {result['steps']} batches, medians",
        "",
        "| pipeline (one process) | rows/s | tokens/s | ours / this |",
        "| --- | ---: | ---: | ---: |",
    ]
    names = {
        "ours": "ours: Plan.batch",
        "grain": "Grain packed (ReadOptions threads={}, buffer={})".format(*result["grain_best"]),
        "format_batched": "format limit: ArrayRecord read(list) per shard",
        "format_per_record": "format limit: ArrayRecord read(i, i+1) per record",
        "copy": "copy limit: np.copyto of the token bytes",
    }
    for name, label in names.items():
        ratio = tps["ours"] / tps[name]
        lines.append(f"| {label} | {tps[name] / width:,.0f} | {tps[name]:,.0f} | {ratio:.2f} |")
    lines += [
        "",
        f"ours / Grain = {tps['ours'] / tps['grain']:.1f}x; ours / format limit "
        f"({limit_name}) = {tps['ours'] / tps[limit_name]:.0%}; ours / copy limit = "
        f"{tps['ours'] / tps['copy']:.1%}",
        f"tokens consumed in the timed repetitions: ours {result['tokens_consumed']['ours']:,}, "
        f"Grain {result['tokens_consumed']['grain']:,}",
        "",
        "| resume: restore to first batch | " + " | ".join(
            f"step {int(s):,}" for s in result["resume_s"]["ours"]) + " | step 10^6 / step 0 |",
        "| --- |" + " ---: |" * (len(result["resume_s"]["ours"]) + 1),
    ]  # fmt: skip
    for name, label in (("ours", "ours (Plan from ledger + batch)"), ("grain", "Grain set_state")):
        times = result["resume_s"][name]
        cells = " | ".join(f"{t * 1e3:.1f} ms" for t in times.values())
        ratio = times[str(10**6)] / times["0"]
        lines.append(f"| {label} | {cells} | {ratio:.2f} |")
    if result["scale"]:
        lines += [
            "",
            "| ours, processes | tokens/s per process | total tokens/s | peak RSS per process |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for processes, runs in result["scale"].items():
            per = [r["tokens_per_s"] for r in runs]
            rss = max(r["peak_rss_mb"] for r in runs)
            lines.append(
                f"| {processes} | {statistics.mean(per):,.0f} | {sum(per):,.0f} | {rss:.0f} MB |"
            )
    overhead = result["stats_overhead"]
    lines += [
        "",
        f"feed statistics: DataFeed step {overhead['step_s']['with'] * 1e3:.2f} ms with, "
        f"{overhead['step_s']['without'] * 1e3:.2f} ms without (interleaved A/B, best of reps: "
        f"{overhead['ab_overhead']:+.1%}); the statistics' calls alone "
        f"{overhead['stats_call_s'] * 1e6:.0f} us per step = {overhead['call_overhead']:.2%} "
        "of a step",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--worker-store", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        scale_worker(args)
        return 0
    return report(args)


def report(args: argparse.Namespace) -> int:
    result = run(args)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
