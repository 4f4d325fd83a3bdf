"""Where the benchmarks make their stores, and whether a store made there is still usable.

The cache (`~/.cache/pipeline-bench` by default) has one folder per pair of store format
versions this code reads and writes (plain, masked), so a cache made by a version with another
format is rebuilt beside it, never read; a store there that no longer opens (an interrupted
run, a lost file) is made again.
"""

from __future__ import annotations

from pathlib import Path


def store_dir(cache: Path) -> Path:
    from pipeline.store.meta import FORMAT_VERSION, MASKED_FORMAT_VERSION

    return cache / f"format-{FORMAT_VERSION}-{MASKED_FORMAT_VERSION}"


def usable(path: Path, flat: bool = True) -> bool:
    """Whether `path` is a store this version opens, with flat sidecars and their block
    checksums in blocks of the size prepare writes when `flat` (a store of an older prepare
    would be hashed whole on first read; one of another block size is checked at another cost)."""
    from pipeline.errors import StoreError
    from pipeline.store import writer
    from pipeline.store.token_store import TokenStore

    try:
        with TokenStore(path) as store:  # every shard's first-use checks: its files are there
            for shard in range(store.num_shards):
                store.record_offsets(shard)
    except StoreError:
        return False
    blocks = {shard.get("flat_block_bytes") for shard in store.manifest["shards"]}
    return not flat or blocks == {writer.BLOCK_BYTES}
