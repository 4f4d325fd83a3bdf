"""Throughput of `prepare`: the local runner beside the Beam runner (DirectRunner), same input.

    .venv/bin/python benchmarks/prepare_bench.py [INPUT ...] [--repeat 3] [--num-shards 8]
        [--tokenizer bytes|sentencepiece:MODEL|hf:JSON] [--workers 1,..,CPUS]
        [--runners local,beam] [--num-proc CPUS]

Every configuration writes the same store (checked: the manifests are identical), so the table
compares only how fast they get there. Each time is the median of `--repeat` rounds, end to end
(validation, tokenizing, sorting, writing, commit; for Beam also pipeline construction and,
with several workers, starting the worker processes); each round runs every row once, the
first row of the round rotating, so that a machine's changing load falls on all rows alike.
Every row runs in a fresh spawned process of its own, which reads the texts, then times itself
(wall, and CPU seconds: its own and its reaped children's, the worker processes, so they stay
comparable on a busy machine, where wall times do not) and sends its figures back. No row
inherits another's state: `datasets.map(num_proc=...)` sets `TOKENIZERS_PARALLELISM=false` in
its process's C environment and restores only a Python copy of `os.environ`, so in a shared
process the `tokenizers` library ran every later `encode_batch` on one thread (the rows after
the peer's, `prepare --workers 1` among them); and the library starts its thread pool once per
process, sized by the environment it sees then. The header gives the 1-minute load average
seen before and after each run. With an `hf:` tokenizer four more rows: the limit, the
tokenizer's own `encode_batch` on the same texts, on its own threads, nothing else; the same on
one thread (`TOKENIZERS_PARALLELISM=false`: the limit per CPU, against which `--workers N` reads
as near-linear or not); its `encode_batch_fast` (the same ids without character offsets: what
`prepare` calls); and the peer, what users of Hugging Face `datasets` run today:
`Dataset.map(batched=True, num_proc=--num-proc)` calling the same tokenizer's `encode_batch`
(the `dev` extra installs `datasets`). They must count the same tokens, or the benchmark stops.
"of the limit" is the limit's seconds over the row's: its tokens/s as a share of the limit's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

from pipeline.ingest.corpora import iter_documents, resolve_inputs
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.ingest.tokenizers import load_tokenizer


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the worker pools)."""
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _measure(row: Callable[[], tuple], send: Connection) -> None:
    """In a row's own process: the row's figures to the bench process."""
    send.send(row())
    send.close()


def measure(row: Callable[[], tuple]) -> tuple:
    """What `row()` returns, computed in a fresh spawned process (see the module docstring)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_measure, args=(row, send))  # not a daemon: it may fork
    child.start()
    send.close()
    try:
        figures = receive.recv()
    except EOFError:  # the row failed: its traceback is on stderr
        figures = None
    child.join()
    if figures is None or child.exitcode != 0:
        raise SystemExit(f"a row's process failed (exit code {child.exitcode})")
    return figures


def _prepare_row(
    runner: str, workers: int, inputs: list[str], out: Path, num_shards: int, tokenizer: str
) -> tuple[float, float, None, Path]:
    """(wall seconds, CPU seconds, no token count, the store) of one prepare."""
    options = PrepareOptions(
        inputs, out, tokenizer=tokenizer, num_shards=num_shards, workers=workers,
        overwrite=True, progress=False,
    )  # fmt: skip
    start, cpu = time.perf_counter(), _cpu_seconds()
    if runner == "local":
        prepare(options)
    else:
        from pipeline.ingest.prepare_beam import prepare_beam  # only when asked: an extra

        prepare_beam(options)
    return time.perf_counter() - start, _cpu_seconds() - cpu, None, out


def _texts(inputs: list[str]) -> list[str]:
    return [doc.text for spec in resolve_inputs(inputs) for doc in iter_documents(spec)]


def _encode_batch_row(
    inputs: list[str], tokenizer: str, fast: bool = False, one_thread: bool = False
) -> tuple[float, float, int, None]:
    """(wall, CPU seconds, tokens, no store) of the hf tokenizer's own encode_batch on the
    texts (with `fast`, its encode_batch_fast: no character offsets, what prepare calls; with
    `one_thread`, on the calling thread only: the limit per CPU)."""
    texts = _texts(inputs)
    model = load_tokenizer(tokenizer)._model
    encode = model.encode_batch_fast if fast else model.encode_batch
    if one_thread:  # this process is the row's own: nothing to restore
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    start, cpu = time.perf_counter(), _cpu_seconds()
    encoded = encode(texts, add_special_tokens=False)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return seconds, cpu, sum(len(e.ids) for e in encoded), None


def _tokenize_rows(batch: dict[str, list], model) -> dict[str, list]:
    """The function `datasets.map(batched=True)` calls: a batch of texts to their ids."""
    encoded = model.encode_batch(batch["text"], add_special_tokens=False)
    return {"input_ids": [e.ids for e in encoded]}


def _datasets_map_row(
    inputs: list[str], tokenizer: str, num_proc: int
) -> tuple[float, float, int, None]:
    """(wall, CPU seconds, tokens, no store) of `Dataset.map(batched=True, num_proc=...)` on
    the texts, from an in-memory dataset to the tokenized one (Arrow files in a temporary
    directory)."""
    try:
        import datasets  # the dev extra: only the peer row needs it
    except ImportError:
        raise SystemExit("the datasets.map row needs `datasets`: pip install -e '.[dev]'") from None
    datasets.disable_caching()  # every repeat tokenizes, as a first run does
    datasets.disable_progress_bars()  # stderr only, but not part of the table
    table = datasets.Dataset.from_dict({"text": _texts(inputs)})
    model = load_tokenizer(tokenizer)._model
    start, cpu = time.perf_counter(), _cpu_seconds()
    mapped = table.map(
        _tokenize_rows, batched=True, num_proc=num_proc, remove_columns=["text"],
        fn_kwargs={"model": model},
    )  # fmt: skip
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return seconds, cpu, sum(len(ids) for ids in mapped["input_ids"]), None


def _rows(args: argparse.Namespace, tmp: str) -> list[tuple[str, str, Callable[[], tuple]]]:
    """The contenders: (name, workers, row -> (wall, CPU seconds, tokens or None, store or
    None)), each row picklable, to run in its own process."""
    rows = []
    for runner in args.runners.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            out = Path(tmp) / f"{runner}-{workers}"
            name = "local" if runner == "local" else "beam (DirectRunner)"
            row = partial(
                _prepare_row, runner, workers, args.inputs, out, args.num_shards, args.tokenizer
            )
            rows.append((name, str(workers), row))
    if args.tokenizer.startswith("hf:"):
        encode = partial(_encode_batch_row, args.inputs, args.tokenizer)
        rows += [
            ("encode_batch (the limit)", "threads", encode),
            ("encode_batch, one thread (the limit per CPU)", "1 thread",
             partial(encode, one_thread=True)),
            ("encode_batch_fast", "threads", partial(encode, fast=True)),
            ("datasets.map (the peer)", f"num_proc={args.num_proc}",
             partial(_datasets_map_row, args.inputs, args.tokenizer, args.num_proc)),
        ]  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", default=["builtin:python-code"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument(
        "--workers",
        default=",".join(str(w) for w in range(1, (os.cpu_count() or 1) + 1)),
        help="worker counts, comma-separated (default 1 .. CPUs)",
    )
    parser.add_argument("--runners", default="local,beam", help="local, beam or both")
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count(), help="datasets.map's processes"
    )
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    loads, manifests, counts = [], set(), set()
    with tempfile.TemporaryDirectory() as tmp:
        rows = _rows(args, tmp)
        for round_ in range(args.repeat):  # interleaved: each round runs every row once
            for name, workers, run in rows[round_ % len(rows) :] + rows[: round_ % len(rows)]:
                loads.append(os.getloadavg()[0])
                seconds, cpu, count, out = measure(run)
                runs.setdefault((name, workers), []).append((seconds, cpu))
                if out is not None:
                    manifest = json.loads((out / "manifest.json").read_text())
                    manifests.add(json.dumps(manifest, sort_keys=True))
                    shutil.rmtree(out)
                else:
                    counts.add(count)
            loads.append(os.getloadavg()[0])
    if len(manifests) != 1:
        raise SystemExit("the runners wrote different stores")
    if len(counts) > 1:
        raise SystemExit(f"encode_batch and datasets.map counted different tokens: {counts}")
    docs, tokens = manifest["num_documents"], manifest["num_tokens"]
    print(
        f"# prepare {' '.join(args.inputs)}: {docs:,} documents, {tokens:,} tokens "
        f"({args.tokenizer})"
    )
    print(
        f"# {datetime.date.today()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, median of {args.repeat} "
        f"interleaved rounds, 1-minute load average {min(loads):.1f} to {max(loads):.1f}"
    )
    print()
    limit = statistics.median(
        wall for wall, _ in runs.get(("encode_batch (the limit)", "threads"), [(0, 0)])
    )
    print(
        "| runner | workers | seconds | CPU seconds | CPU s per M tokens | docs/s | tokens/s "
        "| of the limit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (name, workers), timings in runs.items():
        seconds = statistics.median(wall for wall, _ in timings)
        cpu = statistics.median(cpu for _, cpu in timings)
        share = f"{limit / seconds:.2f}x" if limit else ""
        print(
            f"| {name} | {workers} | {seconds:.2f} | {cpu:.1f} | {cpu / tokens * 1e6:.2f} "
            f"| {docs / seconds:,.0f} | {tokens / seconds:,.0f} | {share} |"
        )
    if counts:
        print()
        print(
            f"# encode_batch and datasets.map: {counts.pop():,} tokens (the store adds one eod "
            "per document); tokens/s and CPU per M tokens are of the store's tokens in every row"
        )


if __name__ == "__main__":
    main()
