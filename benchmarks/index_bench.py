"""What indexing a Megatron dataset in place costs: `pipeline index`, an open, `verify-store`.

    .venv/bin/python benchmarks/index_bench.py --tokens 150000000 --documents 150000

Writes a synthetic uint16 dataset of `--tokens` ids in `--documents` documents into
`--scratch` (so the files are partly in the page cache, as right after a download), then times
`build_index` (what `pipeline index PREFIX` runs: one pass over the `.bin`, the `.idx` hashed),
opening it (`MegatronStore`: the sampled digests and the index's arrays) and `verify()` (what
`verify-store` runs: every byte again), in wall and CPU seconds, and the index's size.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.store.megatron import MegatronStore
from pipeline.store.megatron_format import write_megatron
from pipeline.store.megatron_index import build_index


def timed(what: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = what()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=150_000_000)
    parser.add_argument("--documents", type=int, default=150_000)
    parser.add_argument("--scratch", type=Path, default=None, help="default: a temporary dir")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(dir=args.scratch))
    try:
        rng = np.random.default_rng(0)
        cuts = np.sort(rng.choice(np.arange(1, args.tokens), args.documents - 1, replace=False))
        ids = rng.integers(1, 32_000, args.tokens, dtype=np.uint16)
        write_megatron(scratch / "corpus", [[doc] for doc in np.split(ids, cuts)])
        size = (scratch / "corpus.bin").stat().st_size
        index, wall, cpu = timed(lambda: build_index(scratch / "corpus"))
        print(f"index: {wall:.2f} s wall, {cpu:.2f} CPU-s, {size / wall / 1e6:.0f} MB/s of .bin")
        store, wall, _ = timed(lambda: MegatronStore(index))
        print(f"open: {wall * 1e3:.1f} ms")
        _, wall, cpu = timed(store.verify)
        print(f"verify: {wall:.2f} s wall, {cpu:.2f} CPU-s")
        index_bytes = sum(f.stat().st_size for f in Path(index).iterdir())
        print(f"index directory: {index_bytes / 1e6:.2f} MB for {size / 1e6:.0f} MB of .bin")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
