"""The packed-SFT rows of `pipeline bench`: our best_fit source against Grain's packers.

On one masked store of instruction-like documents (log-normal lengths, a loss mask over each
document's first third), one row length and batch, interleaved and repeated (medians):

* ours, the headline row: `DataFeed(config, mesh)` of a `packing: best_fit` source (whole
  documents, the mask) -> the six global `jax.Array`s on `--devices` simulated CPU devices;
* Grain first-fit / best-fit: `ArrayRecordDataSource` (one record per document) ->
  `shuffle().repeat()` -> `map(inputs = d[:-1], targets = d[1:], truncated to seq_len)` ->
  `to_iter_dataset(ReadOptions)` -> `FirstFitPackIterDataset` / `BestFitPackIterDataset`
  (`num_packing_bins` = rows, as MaxText sets it) -> `batch(rows)` -> the six fields ->
  `make_array_from_process_local_data`; each packer with every ReadOptions of the main table
  (grain_read.GRAIN_READ_OPTIONS), and best-fit with `mp_prefetch` of 1..`--grain-workers`
  processes (default: the cores), all in the same interleaved rounds, named and chosen as the
  main table's (grain_read.py); the summary lines compare DataFeed with Grain's fastest packer
  row in one process and its fastest mp_prefetch row, by this run's medians;
* host only, in this process: `Plan.batch` of the best_fit source, and of the same store as a
  concatenated source (the throughput target: best_fit within 2x of it).

The DataFeed and Grain rows run in contenders.py workers through bench.py's `throughput`
(tokens/s, and CPU seconds per M target slots of the worker and its children; the host rows'
CPU is this process's). Padding fraction is the share of target slots that are padding (input
segment id 0), a worker row's counted from its global arrays after the timed rounds
(`contenders.padding`). Then restore to the first batch of the best_fit source at steps 0, 10^3,
10^6, each in a new process (JAX imported first, as in a trainer): `Plan(ledger).batch(step)`,
which opens the store and reads the packing this process kept on disk (packing_cache.py); and
once with nothing kept (`PIPELINE_PACKING_CACHE=off`), which packs the source.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from grain_read import GRAIN_MP_READ, fastest, grain_label, grain_settings, ratio
from store_cache import store_dir, usable  # beside this file, as bench.py imports it

from pipeline.plan.packing_cache import CACHE_ENV

RESUME_STEPS = (0, 10**3, 10**6)
PACKERS = {"first_fit": "FirstFitPackIterDataset", "best_fit": "BestFitPackIterDataset"}
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-sft", action="store_true", help="skip the packed-SFT rows")
    parser.add_argument("--sft-only", action="store_true", help="run only the packed-SFT rows")
    parser.add_argument(
        "--sft-documents", type=int, default=100_000, help="documents of the packed-SFT store"
    )
    parser.add_argument("--sft-seq-len", type=int, default=1024, help="packed-SFT row length")
    parser.add_argument("--sft-mean-len", type=int, default=300, help="mean tokens/document")


def sft_store(path: Path, documents: int, mean: int, seed: int = 0) -> None:
    """uint16 documents of log-normal lengths, the first third of each untrained."""
    from pipeline.store.writer import (
        commit,
        staging_dir,
        synthetic_tokenizer,
        write_manifest,
        write_shard,
    )

    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(np.log(mean) - 0.5, 1.0, documents).astype(int), 2)
    staging, shards, eod = staging_dir(path), 8, 32_000
    infos = []
    for shard, part in enumerate(np.array_split(lengths, shards)):
        docs = []
        for length in part.tolist():
            tokens = rng.integers(0, eod, size=length, dtype=np.uint16)
            tokens[-1] = eod
            docs.append((tokens, np.array([[0, length // 3]], np.int64).reshape(-1, 2)))
        infos.append(write_shard(staging, shard, shards, docs, np.dtype(np.uint16), 1 << 30,
                                 masked=True))  # fmt: skip
    tokenizer = synthetic_tokenizer(vocab_size=eod + 1, eod_id=eod)
    write_manifest(staging, infos, tokenizer, np.dtype(np.uint16), {"synthetic": True})
    commit(staging, path, overwrite=True)


def _config(store: Path, args: argparse.Namespace, packing: str) -> dict:
    source = {"path": str(store.resolve())}
    if packing != "concat":
        source["packing"] = packing
    return {"seed": 1, "seq_len": args.sft_seq_len, "global_batch_size": args.rows,
            "sources": {"sft": source}, "mix": {"sft": 1}}  # fmt: skip


def _plan(store: Path, args: argparse.Namespace, packing: str):
    from pipeline.config import parse_config
    from pipeline.read.plan import Plan

    return Plan.from_config(parse_config(_config(store, args, packing), origin="bench"))


class OursSft:
    """`Plan.batch`, host only: the batches DataFeed serves, without devices or threads."""

    def __init__(self, plan) -> None:
        self.plan, self.step, self.slots, self.padding = plan, 0, 0, 0

    def batches(self, n: int) -> None:
        for _ in range(n):
            batch = self.plan.batch(self.step)
            self.step += 1
            self.slots += batch["inputs"].size
            self.padding += int((batch["inputs_segmentation"] == 0).sum())


RESTORE = """
import json, sys, time
import jax  # noqa: F401  (a trainer has it imported before it restores)
from pipeline.plan.ledger import Ledger
from pipeline.read.plan import Plan
state, step = json.loads(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter()
Plan(Ledger.from_json(state)).batch(step)
print(time.perf_counter() - start)
"""


def _restore(plan, step: int, packings: str) -> float:
    """Seconds from a saved ledger to the first batch at `step`, in a new process (stores
    opened by the plan; `packings` is $PIPELINE_PACKING_CACHE there: a directory or `off`)."""
    env = {**os.environ, CACHE_ENV: packings, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    state = json.dumps(plan.ledger.to_json())
    result = subprocess.run(
        [sys.executable, "-c", RESTORE, state, str(step)],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return float(result.stdout.split()[-1])


def grain_rows(workers: int) -> dict[str, dict]:
    """Name -> options of every Grain row: first-fit and best-fit with each of the main
    table's ReadOptions, best-fit with its mp_prefetch of 1..`workers` processes."""
    rows = {}
    for packer in PACKERS:
        for suffix, options in grain_settings(workers).items():
            if packer == "best_fit" or not options["workers"]:
                rows[f"grain_{packer}_{suffix}"] = dict(options, packer=packer)
    return rows


def worker_rows(
    path: Path, args: argparse.Namespace, throughput: Callable, close_all: Callable
) -> tuple[dict[str, dict], dict[str, float]]:
    """The DataFeed and Grain rows, each in its contenders.py worker (bench.py's `throughput`,
    interleaved rounds): their summaries and padding fractions."""
    from pipeline.progress import progress_bar

    base = {"config": _config(path, args, "best_fit")}
    specs = {"feed": dict(base, contenders={"feed": "feed"})}
    for name, options in grain_rows(args.grain_workers).items():
        specs[name] = dict(base, contenders={name: "grain_sft"}, grain=options)
    bar = progress_bar(total=len(specs) + args.reps + 1, desc="sft", unit=" phase",
                       enabled=not args.no_progress)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        workers = {}
        try:
            rows, workers = throughput(specs, None, args, Path(tmp), bar)
            padding = {
                name: workers[name].ask({"padding": name, "steps": args.steps})["padding"]
                for name in specs
            }
        finally:
            close_all(list(workers.values()))
    bar.close()
    return rows, padding


def run_sft(args: argparse.Namespace, throughput: Callable, close_all: Callable) -> dict:
    """`throughput` and `close_all` are bench.py's, which imports this file."""
    from pipeline.store.token_store import TokenStore

    path = store_dir(args.cache_dir) / f"sft-{args.sft_documents}-{args.sft_mean_len}"
    if not usable(path, flat=False):
        path.parent.mkdir(parents=True, exist_ok=True)
        sft_store(path, args.sft_documents, args.sft_mean_len)
    store = TokenStore(path)
    rows, padding = worker_rows(path, args, throughput, close_all)
    best_fit = _plan(path, args, "best_fit")
    contenders = {
        "ours_best_fit": OursSft(best_fit),
        "ours_concat": OursSft(_plan(path, args, "concat")),
    }
    for contender in contenders.values():
        contender.batches(2)  # open files
        contender.slots = contender.padding = 0
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    cpu = dict.fromkeys(contenders, 0.0)
    for _ in range(args.reps):
        for name, contender in contenders.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            contender.batches(args.steps)
            seconds[name].append(time.perf_counter() - start)
            cpu[name] += time.process_time() - start_cpu
    slots = args.steps * args.rows * args.sft_seq_len
    padding.update({name: c.padding / c.slots for name, c in contenders.items()})
    packings = os.environ.get(CACHE_ENV, "")  # the packing this process kept (or "off")
    resume = {
        step: statistics.median(_restore(best_fit, step, packings) for _ in range(args.reps))
        for step in RESUME_STEPS
    }
    cold = statistics.median(_restore(best_fit, 0, "off") for _ in range(args.reps))
    stats = best_fit.segment_plan(0).layouts["sft"].stats
    return {
        "store": str(path),
        "documents": store.num_documents,
        "tokens": store.num_tokens,
        "seq_len": args.sft_seq_len,
        "rows": args.rows,
        "devices": args.devices,
        "grain": grain_rows(args.grain_workers),  # name -> options of every Grain row
        "tokens_per_s": {n: r["tokens_per_s"] for n, r in rows.items()}
        | {n: slots / statistics.median(s) for n, s in seconds.items()},
        "cpu_s_per_mtok": {n: r["cpu_s_per_mtok"] for n, r in rows.items()}
        | {n: c / (slots * args.reps) * 1e6 for n, c in cpu.items()},
        "worker_tokens": {n: r["tokens"] for n, r in rows.items()},  # counted from the arrays
        "padding": padding,
        "packing": {"rows": stats.rows, "truncated": stats.truncated, "dropped": stats.dropped,
                    "padding_fraction": stats.padding_fraction},
        "resume_s": {str(k): v for k, v in resume.items()},
        "resume_cold_s": cold,
    }  # fmt: skip


SFT_LABELS = {
    "feed": "**ours: DataFeed (best_fit) -> global arrays**",
    "ours_best_fit": "ours: best_fit source, Plan.batch, host only",
    "ours_concat": "ours: the same store as a concat source, Plan.batch, host only",
}


def sft_label(name: str, grain: dict[str, dict]) -> str:
    """A row's name; a Grain row's from its options (`grain`: name -> options)."""
    if name in SFT_LABELS:
        return SFT_LABELS[name]
    return grain_label(grain[name], PACKERS[grain[name]["packer"]])


def sft_table(result: dict) -> str:
    tps, cpu, padding = result["tokens_per_s"], result["cpu_s_per_mtok"], result["padding"]
    grain = result["grain"]
    mean = result["tokens"] / result["documents"]
    lines = [
        f"packed SFT: {result['documents']:,} documents ({mean:.0f} tokens/document, "
        f"log-normal), rows of {result['seq_len']} target slots, batch {result['rows']}, "
        f"{result['devices']} simulated CPU devices; Grain's packers with num_packing_bins = rows, "
        f"ending in the same global arrays, its mp_prefetch workers reading with "
        f"ReadOptions(num_threads, prefetch_buffer_size) = {GRAIN_MP_READ}",
        "",
        "| packed SFT (one process) | target slots/s | DataFeed / this | CPU s per M slots "
        "| padding |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ["feed", *grain, "ours_best_fit", "ours_concat"]:
        lines.append(
            f"| {sft_label(name, grain)} | {tps[name]:,.0f} | {tps['feed'] / tps[name]:.2f} | "
            f"{cpu[name]:.4f} | {padding[name]:.1%} |"
        )
    lines.append("")
    for mp, what in ((False, "best packer in one process"), (True, "best mp_prefetch")):
        best = fastest(tps, grain, mp)
        if best is not None:
            lines.append(
                f"DataFeed (best_fit) / Grain's {what} ({sft_label(best, grain)}): "
                f"{tps['feed'] / tps[best]:.1f}x target slots/s, "
                f"{ratio(cpu[best], cpu['feed']):.1f}x less CPU per target slot"
            )
    packing = result["packing"]
    cells = " | ".join(f"{t * 1e3:.1f} ms" for t in result["resume_s"].values())
    cold = f"{result['resume_cold_s'] * 1e3:.0f} ms"
    lines += [
        "",
        f"best_fit packing: {packing['rows']:,} rows per epoch, padding "
        f"{packing['padding_fraction']:.1%} over the epoch, {packing['truncated']:,} truncated",
        "",
        "| best_fit: restore to first batch, in a new process | "
        + " | ".join(f"step {int(s):,}" for s in result["resume_s"])
        + " |",
        "| --- |" + " ---: |" * len(result["resume_s"]),
        f"| ours, the packing kept on disk (Plan from the ledger + batch) | {cells} |",
        f"| ours, nothing kept (`{CACHE_ENV}=off`: packs the source) | {cold} |"
        + " |" * (len(result["resume_s"]) - 1),
    ]
    return "\n".join(lines)
