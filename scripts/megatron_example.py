"""Make the data of configs/megatron-in-place.yaml: a Megatron-LM dataset to read in place.

    python scripts/megatron_example.py        # or: make megatron-example

Prepares the builtin python-code and python-docs corpora into data/ (where they are missing),
writes python-docs' documents again as a Megatron dataset (data/megatron/python-docs.bin/.idx,
the bytes tokenizer's ids, each document ending with its eod) and indexes it with `pipeline
index`. Then `pipeline verify configs/megatron-in-place.yaml --steps 0:20` (or any command)
reads it in place (docs/in-place-corpora.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_dataset(store_dir: Path, prefix: Path) -> None:
    """The documents of the token store at `store_dir`, one sequence each, as the Megatron
    dataset `prefix`.bin/.idx (uint16 ids)."""
    from pipeline.store.megatron_format import write_megatron
    from pipeline.store.token_store import TokenStore

    with TokenStore(store_dir) as store:
        documents = [
            [store.document(shard, k).tolist()]
            for shard in range(store.num_shards)
            for k in range(int(store.shard_documents[shard]))
        ]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_megatron(prefix, documents, np.uint16)


def main(data: Path = ROOT / "data") -> int:
    from pipeline.commands.cli import main as pipeline
    from pipeline.store.token_store import is_store

    for name in ("python-code", "python-docs"):
        if not is_store(data / name):
            pipeline(["prepare", f"builtin:{name}", "--out", str(data / name), "--no-progress"])
    prefix = data / "megatron" / "python-docs"
    write_dataset(data / "python-docs", prefix)
    return pipeline(["index", str(prefix)])


if __name__ == "__main__":
    sys.exit(main())
