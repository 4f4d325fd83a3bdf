"""Checksummed reads: one flipped byte in any file the feed serves from stops it, by name.

Under default settings (`feed: {verify: read}`), a flipped byte in a shard's flat token sidecar,
its record or document index, its loss mask or its block checksum file stops the read that
would serve it with one line naming the config key and the file, before a wrong batch is
served; `verify: off` serves what the sidecar holds, as before block checksums existed.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.errors import FeedError
from pipeline.feed.data_feed import DataFeed
from pipeline.read.plan import Plan
from pipeline.store import flat_blocks, writer
from pipeline.store.identity import manifest_digest
from pipeline.store.meta import MANIFEST
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import (
    commit,
    staging_dir,
    synthetic_tokenizer,
    write_manifest,
    write_shard,
)
from tests.test_checkpoint import mesh
from tests.test_faults import cli, config_over, one_line, write_yaml

VOCAB = 257  # the campaign's: a flipped high byte serves an id far above it
SHARDS = [[700, 900, 400], [1500, 2500]]  # tokens per document
BLOCK = 1024  # bytes per checksummed block of these stores: 4 and 8 blocks per shard
STEPS = 140  # more than an epoch of the config below: every window is read
DTYPE = np.dtype(np.uint16)


def masked_store(path: Path, block: int = BLOCK) -> Path:
    """A masked store of random ids below `VOCAB` (each document's first token untrained),
    with flat sidecars and their block checksums, of `block` bytes (recorded in the manifest,
    which readers follow): by default a shard of several blocks."""
    rng = np.random.default_rng(0)
    staging = staging_dir(path)
    infos = []
    for index, lengths in enumerate(SHARDS):
        docs = [
            (rng.integers(0, VOCAB - 1, length).astype(DTYPE), np.array([[0, 1]]))
            for length in lengths
        ]
        with mock.patch.object(writer, "BLOCK_BYTES", block):
            infos.append(write_shard(staging, index, len(SHARDS), docs, DTYPE, 256, masked=True))
    write_manifest(staging, infos, synthetic_tokenizer(VOCAB, VOCAB - 1), DTYPE, {})
    commit(staging, path, overwrite=False)
    return path


def flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def middle_offsets(file: Path, itemsize: int) -> dict[str, int]:
    """The middle byte of the file, and the high (little-endian: last) byte of the item at the
    middle of its data; a .npy file's data starts after its header."""
    size = file.stat().st_size
    header = 0
    if file.suffix == ".npy":
        header = size - np.load(file).nbytes
    middle = header + (size - header) // 2
    return {"middle": middle, "high": middle - (middle - header) % itemsize + itemsize - 1}


FILES = {  # suffix: item size
    "flat.bin": DTYPE.itemsize,
    "index.npy": 8,
    "docs.npy": 8,
    "untrained.npy": 8,
    "blocks.npy": 4,
}


def data_config(tmp_path: Path, store: Path, **feed: object) -> Path:
    raw = (
        config_over(tmp_path, {"s": store}, feed=feed)
        if feed
        else config_over(tmp_path, {"s": store})
    )
    return write_yaml(tmp_path / "data.yaml", raw)


@pytest.mark.parametrize("where", ["middle", "high"])
@pytest.mark.parametrize("suffix", FILES)
def test_a_flipped_byte_in_any_file_served_from_stops_the_dump(tmp_path, capsys, suffix, where):
    store = masked_store(tmp_path / "store")
    config = data_config(tmp_path, store)
    damaged = store / f"shard-00001-of-00002.{suffix}"
    flip(damaged, middle_offsets(damaged, FILES[suffix])[where])
    out = tmp_path / "o.npz"
    code, err = cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", out)
    assert code == 2 and err.startswith(f"error: {config}: sources.s.path: {damaged}: "), err
    assert not out.exists()


@pytest.mark.parametrize("where", ["middle", "high"])
def test_verify_off_serves_a_flipped_sidecar_byte_as_before(tmp_path, capsys, where):
    """The flip is in what is served: `verify: off` serves it (the high byte: an id far above
    the vocabulary), as a feed did before block checksums."""
    store = masked_store(tmp_path / "store")
    clean, out = tmp_path / "clean.npz", tmp_path / "o.npz"
    config = data_config(tmp_path, store, verify="off")
    assert cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", clean)[0] == 0
    damaged = store / "shard-00001-of-00002.flat.bin"
    flip(damaged, middle_offsets(damaged, 2)[where])
    assert cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", out)[0] == 0
    changed = np.load(out)["inputs"] != np.load(clean)["inputs"]
    assert changed.any()
    if where == "high":
        assert np.load(out)["inputs"].max() >= VOCAB


@pytest.mark.parametrize("where", ["middle", "high"])
def test_the_feed_stops_before_serving_a_batch_with_a_flipped_byte(tmp_path, where):
    """Every batch `DataFeed` serves before it stops is the clean store's."""
    store = masked_store(tmp_path / "store")
    raw = config_over(tmp_path, {"s": store})
    with DataFeed(parse_config(raw, "d.yaml"), mesh()) as feed:
        clean = [np.asarray(next(feed)["inputs"]) for _ in range(STEPS)]
    damaged = store / "shard-00001-of-00002.flat.bin"
    flip(damaged, middle_offsets(damaged, 2)[where])
    served = []
    feed = DataFeed(parse_config(raw, "d.yaml"), mesh())
    with feed, pytest.raises(FeedError) as info:
        for _ in range(STEPS):
            served.append(np.asarray(next(feed)["inputs"]))
    named = f": cannot read the batch: d.yaml: sources.s.path: {damaged}: bytes "
    assert re.match(rf"step \d+{re.escape(named)}", one_line(info.value)), info.value
    assert len(served) < STEPS
    for got, expected in zip(served, clean):
        np.testing.assert_array_equal(got, expected)


def test_each_block_is_checked_once_per_open_store(tmp_path, monkeypatch):
    """Reads of a block after its first cost no checksum: over two passes of reads in pieces
    of 100 tokens (blocks of 512 tokens), every byte is hashed once, in the first."""
    store = masked_store(tmp_path / "store")
    hashed = []
    real = flat_blocks.google_crc32c.extend

    def counted(crc, data):
        hashed.append(data.size)
        return real(crc, data)

    monkeypatch.setattr(flat_blocks.google_crc32c, "extend", counted)
    opened = TokenStore(store)
    for _ in range(2):
        for shard, lengths in enumerate(SHARDS):
            for start in range(0, sum(lengths), 100):
                stop = min(start + 100, sum(lengths))
                assert opened.flat_blocks(shard).read(start, stop).size == stop - start
        assert sum(hashed) == sum(map(sum, SHARDS)) * DTYPE.itemsize
    assert len(hashed) == sum(-(-n * DTYPE.itemsize // BLOCK) for n in map(sum, SHARDS))


def test_a_store_of_another_block_size_serves_the_same_batches_checked(tmp_path, capsys):
    """Readers follow the manifest's `flat_block_bytes`, not the size prepare writes now: a
    store of 2 KiB blocks serves the batches a store of the writer's blocks serves, and a
    flipped byte stops the dump at the first read of its 2 KiB block, not of a whole sidecar."""
    other = 2048
    assert other != flat_blocks.BLOCK_BYTES
    dumps = []
    for name, block in (("writer", flat_blocks.BLOCK_BYTES), ("other", other)):
        store = masked_store(tmp_path / name, block)
        assert {s["flat_block_bytes"] for s in TokenStore(store).manifest["shards"]} == {block}
        config = write_yaml(tmp_path / f"{name}.yaml", config_over(tmp_path, {"s": store}))
        dumps.append(tmp_path / f"{name}.npz")
        assert cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", dumps[-1])[0] == 0
    np.testing.assert_array_equal(np.load(dumps[0])["inputs"], np.load(dumps[1])["inputs"])
    damaged = store / "shard-00001-of-00002.flat.bin"
    offset = middle_offsets(damaged, 2)["high"]
    flip(damaged, offset)
    code, err = cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", tmp_path / "o")
    assert code == 2 and err.startswith(f"error: {config}: sources.s.path: {damaged}: bytes "), err
    first, last = map(int, re.search(r"bytes (\d+)\.\.(\d+) ", err).groups())
    size = damaged.stat().st_size
    assert first % other == 0 and ((last + 1) % other == 0 or last + 1 == size), err
    assert first <= offset <= last and last - first + 1 < size, err


def test_a_store_without_block_checksums_is_checked_whole_on_first_read(tmp_path, capsys):
    """A store prepared before block checksums: each sidecar is hashed whole against the
    manifest's flat_sha256 on its shard's first read, so a flip is still not served."""
    store = masked_store(tmp_path / "store")
    manifest = json.loads((store / MANIFEST).read_text())
    for entry in manifest["shards"]:
        (store / entry.pop("flat_blocks")).unlink()
        del entry["flat_blocks_sha256"], entry["flat_block_bytes"]
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))
    config = data_config(tmp_path, store)
    out = tmp_path / "o.npz"
    assert cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", out)[0] == 0
    damaged = store / "shard-00001-of-00002.flat.bin"
    flip(damaged, middle_offsets(damaged, 2)["high"])
    code, err = cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", out)
    assert code == 2 and err.startswith(f"error: {config}: sources.s.path: {damaged}: ")
    assert "flat_sha256" in err


def test_a_resealed_block_size_is_blamed_on_the_manifest(tmp_path, capsys):
    """The block checksum file matches its checksum, so the manifest's block size was edited."""
    store = masked_store(tmp_path / "store")
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][1]["flat_block_bytes"] = 2 * BLOCK
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))
    config = data_config(tmp_path, store)
    code, err = cli(capsys, "dump", config, "--steps", f"0:{STEPS}", "--out", tmp_path / "o")
    assert code == 2 and err.startswith(f"error: {config}: sources.s.path: {store / MANIFEST}: ")
    assert "needs uint32[5] block checksums" in err and "is uint32[9]" in err


@pytest.mark.parametrize(("verify", "checked"), [("off", False), ("read", True)])
def test_a_plan_in_another_process_checks_reads_as_its_config_says(tmp_path, verify, checked):
    """A pickled plan (Grain's workers of `host_dataset`) opens its stores itself: with the
    config's `verify`, not the default."""
    store = masked_store(tmp_path / "store")
    raw = config_over(tmp_path, {"s": store}, feed={"verify": verify})
    plan = pickle.loads(pickle.dumps(Plan.from_config(parse_config(raw, "d.yaml"))))
    plan.batch(0)
    assert [s.check_reads for s in plan.stores()] == [checked]
