"""Throughput of `prepare`: the local runner beside the Beam runner (DirectRunner), same input.

    .venv/bin/python benchmarks/prepare_bench.py [INPUT ...] [--repeat 3] [--num-shards 8]
        [--tokenizer bytes|sentencepiece:MODEL|hf:JSON] [--workers 1,2] [--runners local,beam]
        [--num-proc CPUS]

Every configuration writes the same store (checked: the manifests are identical), so the table
compares only how fast they get there. Each time is the median of `--repeat` runs, end to end
(validation, tokenizing, sorting, writing, commit; for Beam also pipeline construction and,
with several workers, starting the worker processes). CPU seconds are this process's and its
reaped children's (the worker processes), so they stay comparable on a busy machine, where
wall times do not. With an `hf:` tokenizer two last rows: the limit, the tokenizer's own
`encode_batch` on the same texts, in this process (its own threads), nothing else; and the
peer, what users of Hugging Face `datasets` run today: `Dataset.map(batched=True,
num_proc=--num-proc)` calling the same tokenizer's `encode_batch` (the `dev` extra installs
`datasets`). Both must count the same tokens, or the benchmark stops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
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


def _run(
    runner: str, workers: int, inputs: list[str], out: Path, num_shards: int, tokenizer: str
) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one prepare."""
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
    return time.perf_counter() - start, _cpu_seconds() - cpu


def _encode_batch(texts: list[str], tokenizer: str) -> tuple[float, float, int]:
    """(wall, CPU seconds, tokens) of the hf tokenizer's own encode_batch on the texts."""
    model = load_tokenizer(tokenizer)._model
    start, cpu = time.perf_counter(), _cpu_seconds()
    encoded = model.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - start, _cpu_seconds() - cpu, sum(len(e.ids) for e in encoded)


def _tokenize_rows(batch: dict[str, list], model) -> dict[str, list]:
    """The function `datasets.map(batched=True)` calls: a batch of texts to their ids."""
    encoded = model.encode_batch(batch["text"], add_special_tokens=False)
    return {"input_ids": [e.ids for e in encoded]}


def _datasets_map(texts: list[str], tokenizer: str, num_proc: int) -> tuple[float, float, int]:
    """(wall, CPU seconds, tokens) of `Dataset.map(batched=True, num_proc=...)` on the texts,
    from an in-memory dataset to the tokenized one (Arrow files in a temporary directory)."""
    try:
        import datasets  # the dev extra: only the peer row needs it
    except ImportError:
        raise SystemExit("the datasets.map row needs `datasets`: pip install -e '.[dev]'") from None
    datasets.disable_caching()  # every repeat tokenizes, as a first run does
    datasets.disable_progress_bars()  # stderr only, but not part of the table
    table = datasets.Dataset.from_dict({"text": texts})
    model = load_tokenizer(tokenizer)._model
    start, cpu = time.perf_counter(), _cpu_seconds()
    mapped = table.map(
        _tokenize_rows, batched=True, num_proc=num_proc, remove_columns=["text"],
        fn_kwargs={"model": model},
    )  # fmt: skip
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return seconds, cpu, sum(len(ids) for ids in mapped["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", default=["builtin:python-code"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--runners", default="local,beam", help="local, beam or both")
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count(), help="datasets.map's processes"
    )
    args = parser.parse_args()
    configs = [
        (runner, int(workers))
        for runner in args.runners.split(",")
        for workers in args.workers.split(",")
    ]
    rows, manifests = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for runner, workers in configs:
            out = Path(tmp) / f"{runner}-{workers}"
            runs = [
                _run(runner, workers, args.inputs, out, args.num_shards, args.tokenizer)
                for _ in range(args.repeat)
            ]
            manifest = json.loads((out / "manifest.json").read_text())
            manifests.add(json.dumps(manifest, sort_keys=True))
            seconds = statistics.median(wall for wall, _ in runs)
            cpu = statistics.median(cpu for _, cpu in runs)
            rows.append((runner, workers, seconds, cpu))
            shutil.rmtree(out)
    if len(manifests) != 1:
        raise SystemExit("the runners wrote different stores")
    docs, tokens = manifest["num_documents"], manifest["num_tokens"]
    print(
        f"# prepare {' '.join(args.inputs)}: {docs:,} documents, {tokens:,} tokens "
        f"({args.tokenizer})"
    )
    print(
        f"# {datetime.date.today()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, median of {args.repeat}"
    )
    print()
    print("| runner | workers | seconds | CPU seconds | docs/s | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for runner, workers, seconds, cpu in rows:
        name = "local" if runner == "local" else "beam (DirectRunner)"
        print(
            f"| {name} | {workers} | {seconds:.2f} | {cpu:.1f} | {docs / seconds:,.0f} "
            f"| {tokens / seconds:,.0f} |"
        )
    if args.tokenizer.startswith("hf:"):
        texts = [doc.text for spec in resolve_inputs(args.inputs) for doc in iter_documents(spec)]
        limit = _encode_batch(texts, args.tokenizer)
        peer = _datasets_map(texts, args.tokenizer, args.num_proc)
        if limit[2] != peer[2]:
            raise SystemExit(f"encode_batch counted {limit[2]:,} tokens, datasets.map {peer[2]:,}")
        for name, workers, (seconds, cpu, count) in (
            ("encode_batch (the limit)", "threads", limit),
            ("datasets.map (the peer)", f"num_proc={args.num_proc}", peer),
        ):
            print(
                f"| {name} | {workers} | {seconds:.2f} | {cpu:.1f} "
                f"| {docs / seconds:,.0f} | {count / seconds:,.0f} |"
            )
        print()
        print(f"# encode_batch and datasets.map: {limit[2]:,} tokens of {len(texts):,} texts")


if __name__ == "__main__":
    main()
