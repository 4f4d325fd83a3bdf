"""A prototype, not adopted: a step's block checks in one compiled call over 4 KiB recorded CRCs.

    .venv/bin/python benchmarks/compiled_check.py --shares 0.13 0.27 1.0 --rounds 7

What checked reads would cost with finer recorded CRCs and no Python call per window
(docs/benchmarks.md, "Checked reads on the mixture"). `check_step` (numba, nogil) takes a step's
window starts in one sidecar, finds the 4 KiB blocks they touch that are not checked yet and
checks each against the recorded running CRC32Cs (`flat_blocks.prefix_crcs`): the CRC at its
start, extended over its bytes by the SSE4.2 `crc32` instruction, must give the CRC at its end.
Blocks are independent chains, so three are hashed at once (the instruction's latency is three
times its throughput). A mismatch returns the block before anything is marked.

The measurement: the sidecars of a built-in store (`--store`, the bench's cache) laid end to end
in one file, padded to whole 64 KiB blocks (the prototype checks whole blocks only), mapped afresh
per round; random 2,049-token windows making `share` of its tokens, 32 a step, each step's
windows copied as `piece_reads` copies them (one `np.concatenate` into an int32 batch). Five
ways, in alternating order each round: no check; `FlatBlocks.read` per window on 64 KiB blocks
(today's) and on 4 KiB blocks; `check_step` then the copy, on 4 KiB blocks (`compiled`) and on
64 KiB ones (what a compiled check saves on today's stores). Prints the unchecked CPU per
window and what each check adds, medians of `--rounds`. x86-64 with SSE4.2 only.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # benchmarks/bench.py, beside this file

from pipeline.store.flat_blocks import FlatBlocks, prefix_crcs

BLOCK = 4096  # bytes per recorded CRC of the prototype's format
PADDED = 65536  # the joined sidecar is whole blocks of both sizes
WINDOW = 2049  # tokens per window: a 2,048-token row and its next token
ROWS = 32  # windows per step
MASK = np.uint64(0xFFFFFFFF)


@intrinsic
def _crc64(typingctx, crc, word):
    """The CRC32C of `crc` extended by one 8-byte word: one SSE4.2 `crc32` instruction."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, list(args))

    return types.uint64(types.uint64, types.uint64), codegen


@njit(nogil=True, cache=True)
def _extend(crcs, words, block, words_per_block):
    """Whether block `block` (its words) extends recorded CRC `block` to recorded CRC
    `block + 1` (CRC32C: the state is the CRC inverted)."""
    crc = np.uint64(crcs[block]) ^ MASK
    at = block * words_per_block
    for w in range(words_per_block):
        crc = _crc64(crc, words[at + w])
    return (crc ^ MASK) & MASK == crcs[block + 1]


@njit(nogil=True, cache=True)
def check_step(words, crcs, checked, starts, length, shift, words_per_block, todo):
    """Check the blocks not checked yet (`checked[b] == 0`) that tokens [s, s + length) of
    each of `starts` touch (a block holds 1 << `shift` tokens), three at a time, and mark them
    checked; -1, or the first block that fails (then nothing is marked). `todo`: scratch of at
    least as many entries as the windows touch blocks."""
    n = 0
    for s in starts:
        for block in range(s >> shift, ((s + length - 1) >> shift) + 1):
            if checked[block] == 0:
                checked[block] = 2  # queued: a block two windows share is hashed once
                todo[n] = block
                n += 1
    failed = -1
    i = 0
    while i + 3 <= n and failed < 0:
        a, b, c = todo[i], todo[i + 1], todo[i + 2]
        ca, cb, cc = np.uint64(crcs[a]) ^ MASK, np.uint64(crcs[b]) ^ MASK, np.uint64(crcs[c]) ^ MASK
        pa, pb, pc = a * words_per_block, b * words_per_block, c * words_per_block
        for w in range(words_per_block):
            ca = _crc64(ca, words[pa + w])
            cb = _crc64(cb, words[pb + w])
            cc = _crc64(cc, words[pc + w])
        for block, crc in ((a, ca), (b, cb), (c, cc)):
            if failed < 0 and (crc ^ MASK) & MASK != crcs[block + 1]:
                failed = block
        i += 3
    while i < n and failed < 0:
        if not _extend(crcs, words, todo[i], words_per_block):
            failed = todo[i]
        i += 1
    for k in range(n):
        checked[todo[k]] = 1 if failed < 0 else 0
    return failed


@intrinsic
def _pointer(typingctx, address):
    """The int64 `address` as a void pointer, for `numba.carray`."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.voidptr(address), codegen


@njit(nogil=True, cache=True)
def _words(table, s):
    """Shard `s`'s whole blocks as 8-byte words (`native_read`'s table row)."""
    return carray(_pointer(table[s, 0]), (table[s, 10] * table[s, 11],), np.uint64)


@njit(nogil=True, cache=True)
def check_pieces(table, slot, lo, hi):
    """`native_read._unchecked`'s contract (the pieces `FlatBlocks.read` must read first),
    checking here what it can: every whole block a piece touches that is not checked yet,
    against the shard's recorded CRCs (columns 8-11 of `native_read`'s table), three blocks at
    once, then marked. Left to `FlatBlocks.read`: pieces touching a shard's short last block,
    a shard without block CRCs, or a block that fails (unmarked, so that its read raises the
    one-line error)."""
    span = 0
    for i in range(slot.size):
        span += ((hi[i] - 1) >> table[slot[i], 7]) - (lo[i] >> table[slot[i], 7]) + 1
    queued = np.empty((span, 3), np.int64)  # (shard slot, block, piece)
    python = np.empty(slot.size + span, np.int64)
    q = count = 0
    for i in range(slot.size):
        s = slot[i]
        checked = carray(_pointer(table[s, 5]), (table[s, 6],), np.uint8)
        shift = table[s, 7]
        handed = False
        for block in range(lo[i] >> shift, ((hi[i] - 1) >> shift) + 1):
            if checked[block] == 0:
                if table[s, 8] == 0 or block >= table[s, 11]:
                    handed = True
                else:
                    checked[block] = 2  # queued: a block two pieces share is hashed once
                    queued[q, 0], queued[q, 1], queued[q, 2] = s, block, i
                    q += 1
        if handed:
            python[count] = i
            count += 1
    passed = np.zeros(q, np.bool_)
    k = 0
    while k < q:
        lanes = min(3, q - k)
        crc = np.empty(3, np.uint64)
        for lane in range(lanes):
            s, block = queued[k + lane, 0], queued[k + lane, 1]
            crcs = carray(_pointer(table[s, 8]), (table[s, 9],), np.uint32)
            crc[lane] = np.uint64(crcs[block]) ^ MASK
        if lanes == 3:
            a, b, c = queued[k, 0], queued[k + 1, 0], queued[k + 2, 0]
            wa, wb, wc = _words(table, a), _words(table, b), _words(table, c)
            pa, pb, pc = (
                queued[k, 1] * table[a, 10],
                queued[k + 1, 1] * table[b, 10],
                queued[k + 2, 1] * table[c, 10],
            )
            ca, cb, cc = crc[0], crc[1], crc[2]
            for w in range(min(table[a, 10], table[b, 10], table[c, 10])):
                ca = _crc64(ca, wa[pa + w])
                cb = _crc64(cb, wb[pb + w])
                cc = _crc64(cc, wc[pc + w])
            crc[0], crc[1], crc[2] = ca, cb, cc
            # blocks of unequal sizes (stores of several block sizes): the rest one by one
            for lane, (s, at) in enumerate(((a, pa), (b, pb), (c, pc))):
                words = _words(table, s)
                for w in range(min(table[a, 10], table[b, 10], table[c, 10]), table[s, 10]):
                    crc[lane] = _crc64(crc[lane], words[at + w])
        else:
            for lane in range(lanes):
                s, block = queued[k + lane, 0], queued[k + lane, 1]
                words, at = _words(table, s), block * table[s, 10]
                for w in range(table[s, 10]):
                    crc[lane] = _crc64(crc[lane], words[at + w])
        for lane in range(lanes):
            s, block = queued[k + lane, 0], queued[k + lane, 1]
            crcs = carray(_pointer(table[s, 8]), (table[s, 9],), np.uint32)
            passed[k + lane] = (crc[lane] ^ MASK) & MASK == crcs[block + 1]
        k += lanes
    for k in range(q):
        s, block = queued[k, 0], queued[k, 1]
        checked = carray(_pointer(table[s, 5]), (table[s, 6],), np.uint8)
        checked[block] = 1 if passed[k] else 0
        if not passed[k]:
            python[count] = queued[k, 2]
            count += 1
    return python[:count]


def use() -> None:
    """`native_read`'s compiled assembly in this process's read path, its blocks checked by
    `check_pieces` rather than `FlatBlocks.read`."""
    import native_read  # beside this file

    native_read.use()
    native_read._unchecked = check_pieces


def joined_sidecars(store: Path, folder: Path) -> Path:
    """The store's flat sidecars end to end in one file, padded to whole blocks."""
    from pipeline.store.token_store import TokenStore

    with TokenStore(store) as opened:
        shards = opened.manifest["shards"]
    path = folder / "joined.flat.bin"
    with path.open("wb") as out:
        for shard in shards:
            out.write((store / shard["flat"]).read_bytes())
        out.write(b"\0" * (-out.tell() % PADDED))
    return path


def per_window(path: Path, crcs: dict[int, np.ndarray], way: str, share: float, seed: int) -> float:
    """CPU s per window of reading `share` of the joined sidecar at `path`, mapped afresh, in
    steps of `ROWS` random windows, checked `way`."""
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    tokens = np.frombuffer(mapped, np.uint16)
    windows = tokens.size // WINDOW - 1
    starts = np.random.default_rng(seed).choice(windows, int(windows * share), replace=False)
    steps = (starts[: len(starts) // ROWS * ROWS].reshape(-1, ROWS) * WINDOW).tolist()
    batch = np.empty(ROWS * WINDOW, np.int32)
    if way.startswith("compiled"):
        size = BLOCK if way == "compiled" else PADDED
        words, recorded = np.frombuffer(mapped, np.uint64), crcs[size]
        checked, todo = np.zeros(recorded.size - 1, np.uint8), np.empty(ROWS * 3, np.int64)
        shift = (size // tokens.itemsize).bit_length() - 1
        as_arrays = [np.array(step, np.int64) for step in steps]  # what a plan's step holds
        start = time.process_time()
        for step, at in zip(steps, as_arrays):
            if check_step(words, recorded, checked, at, WINDOW, shift, size // 8, todo) >= 0:
                raise SystemExit(f"{path}: a block does not match its recorded CRC")
            np.concatenate([tokens[s : s + WINDOW] for s in step], out=batch, casting="unsafe")
        return (time.process_time() - start) / (len(steps) * ROWS)
    size = {"off": 65536, "python 64 KiB": 65536, "python 4 KiB": BLOCK}[way]
    flat = FlatBlocks(
        path, tokens, crcs[size], block_bytes=size, whole_sha256="", check=way != "off"
    )
    start = time.process_time()
    for step in steps:
        np.concatenate([flat.read(s, s + WINDOW) for s in step], out=batch, casting="unsafe")
    return (time.process_time() - start) / (len(steps) * ROWS)


def _differences(config: dict, steps: int, rounds: int, compiled: bool) -> list[float]:
    """`bench.checked_reads_differences` in this (new) process, through the compiled assembly
    and check when `compiled`."""
    if compiled:
        use()
    return bench.checked_reads_differences(config, steps, rounds)


def in_path(args: argparse.Namespace) -> None:
    """The checks alone of `pipeline bench` (`bench.checked_reads_differences`: `Plan.batch`
    from fresh stores, `verify: read` less `verify: off`) on `--in-path-store`, on 64 KiB blocks
    and on `--in-path-block`, by path: the Python path, and `native_read`'s compiled assembly
    with `check_pieces` (its `verify: off` side the compiled assembly too). Each figure the
    median of `--processes` new processes' medians, the four run in turn, alternating."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from pipeline.store import writer

    configs = {}
    for size in (65536, args.in_path_block):
        writer.BLOCK_BYTES = size  # the stores prepared (once) with this block size
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        cache = args.cache_dir if size == 65536 else args.cache_dir / f"blocks-{size}"
        options = parser.parse_args(["--store", args.in_path_store, "--cache-dir", str(cache)])
        configs[size] = bench.config_mapping(bench.resolve_sources(options), options)
    ways = [(size, compiled) for size in configs for compiled in (False, True)]
    medians: dict[tuple[int, bool], list[float]] = {way: [] for way in ways}
    for process in range(args.processes):
        for size, compiled in ways if process % 2 == 0 else ways[::-1]:
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                work = pool.submit(_differences, configs[size], args.in_path, args.rounds, compiled)
                medians[size, compiled].append(statistics.median(work.result()))
    for (size, compiled), found in medians.items():
        path = "compiled assembly and check" if compiled else "Python path"
        print(
            f"{args.in_path_store}, {args.in_path} steps, blocks of {size} bytes, {path}: checks "
            f"alone {statistics.median(found) * 1e6:+.4f} CPU s per M tokens ({args.rounds} "
            f"rounds in each of {len(found)} processes, from {min(found) * 1e6:+.4f} to "
            f"{max(found) * 1e6:+.4f})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="python-tests", help="a built-in store of the bench")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.13, 0.27, 1.0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache-dir", type=Path, default=bench.CACHE, help="the bench's stores")
    parser.add_argument(
        "--in-path", type=int, metavar="STEPS", help="instead, the checks alone in Plan.batch"
    )
    parser.add_argument("--in-path-store", default="mixture", help="the bench's --store")
    parser.add_argument("--in-path-block", type=int, default=BLOCK, help="the finer block size")
    parser.add_argument("--processes", type=int, default=3, help="new processes (--in-path)")
    args = parser.parse_args()
    if args.in_path:
        in_path(args)
        return
    ways = ["off", "python 64 KiB", "python 4 KiB", "compiled", "compiled 64 KiB"]
    with tempfile.TemporaryDirectory() as folder:
        path = joined_sidecars(bench.builtin_store(args.store, args.cache_dir), Path(folder))
        crcs = {size: prefix_crcs(path, size) for size in (BLOCK, PADDED)}
        per_window(path, crcs, "compiled", 0.01, 0)  # compiled (or loaded from numba's cache)
        for share in args.shares:
            spent: dict[str, list[float]] = {way: [] for way in ways}
            for round_ in range(args.rounds):
                for way in ways if round_ % 2 == 0 else ways[::-1]:
                    spent[way].append(per_window(path, crcs, way, share, round_))
            off = statistics.median(spent["off"])
            added = {way: statistics.median(spent[way]) - off for way in ways[1:]}
            print(
                f"{args.store} ({os.path.getsize(path):,} bytes), {share:.0%} of its windows: "
                f"unchecked {off * 1e6:.2f} us per window; checks add "
                + ", ".join(
                    f"{way} {extra * 1e6:+.2f} us ({extra / WINDOW * 1e9:+.3f} ns per token)"
                    for way, extra in added.items()
                )
                + f" ({args.rounds} rounds)",
                flush=True,
            )


if __name__ == "__main__":
    main()
