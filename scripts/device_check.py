"""The feed's accelerator claims, measured on the accelerator: run it whenever one is available.

    scripts/device_check.sh [--out FILE]          # the wrapper: picks the CPU fallback itself

On the devices JAX sees (every one, in a 1-D "data" mesh), from a synthetic store it prepares
once (uint16 ids, a 32,000-token vocabulary; 1,000 in the fallback), in this order:

1. the compact transfer and the on-device expansion (`feed: {expand: device}`) against the six
   fields transferred as read (`expand: host`), for windows (`concat`) and whole documents
   (`best_fit`): bit-identity of every field (values, dtype, sharding) on every step, and the
   wall and process CPU time per step of each path, interleaved rounds, medians; and the
   expansion alone on the device;
2. host-to-device bandwidth: `jax.device_put` of a 256 MiB buffer to one device, against the
   link's limit (PCIe generation x width from `nvidia-smi`, or `--link-gbs`), and the feed's
   own transfer of a step (the compact form) as bytes per second;
3. the input-bound fraction of a training step: scripts/tiny_lm.py made wider until one step
   takes 50-200 ms on the device, run on a fixed on-device batch and on `DataFeed` (each step
   waited for, as a trainer that logs its loss does), alternately: the share of the
   wall time spent in `next()` and the feed's extra wall and process CPU per step;
4. the feed's CPU per step, free-running (process CPU, and the training thread's CPU in
   `next()`), `expand: host` against `expand: device`, interleaved.

It prints a markdown table (date, device, JAX version, commit) and writes it to `--out`, to be
appended under docs/benchmarks.md. Bounded: on one GPU it finishes in under 8 minutes; on CPU
(`--small`, what the wrapper passes when JAX sees no accelerator) a few steps of small batches
on 2 simulated devices, so the suite runs it (tests/test_device_check.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

STEP_MS = (50.0, 200.0)  # the training step the input-bound fraction is measured against
# (width, depth) of the tiny LM tried in turn until a step takes STEP_MS[0] or more
MODELS = ((512, 2), (1024, 4), (1024, 8), (2048, 8), (2048, 16))
PCIE_GBS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # one direction, after encoding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "device_check.md")
    parser.add_argument("--small", action="store_true", help="the CPU fallback: a few steps")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the store is made")
    parser.add_argument("--link-gbs", type=float, help="the host-device link's GB/s limit")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")


def sizes(small: bool) -> dict[str, int]:
    """Batch, store and step counts of a full run and of the CPU fallback."""
    if small:
        return {"rows": 4, "seq_len": 128, "tokens": 60_000, "vocab": 1_000, "steps": 3,
                "rounds": 2, "train_steps": 2, "train_rounds": 1, "bandwidth_mib": 8}  # fmt: skip
    return {"rows": 32, "seq_len": 2048, "tokens": 8_000_000, "vocab": 32_000, "steps": 50,
            "rounds": 5, "train_steps": 20, "train_rounds": 3, "bandwidth_mib": 256}  # fmt: skip


def timed(call: Callable[[int], object], steps: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per step of `call(step)` for steps 1..steps, each waited for."""
    import jax

    jax.block_until_ready(call(0))
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        jax.block_until_ready(call(step))
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def interleaved(parts: dict[str, Callable[[int], object]], steps: int, rounds: int) -> dict:
    """Median (wall ms, CPU ms) per step of each part over `rounds` interleaved rounds."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, call in parts.items():
            runs[name].append(timed(call, steps))
    return {name: tuple(statistics.median(v) for v in zip(*r)) for name, r in runs.items()}


def same(a: dict, b: dict) -> bool:
    """Every field of `b` equals `a`'s: values, dtype, shape and sharding."""
    import jax

    from pipeline.read.batch import FIELDS

    return all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and a[k].sharding == b[k].sharding
        and np.array_equal(jax.device_get(a[k]), jax.device_get(b[k]))
        for k in FIELDS
    )


def expansion(raw: dict, mesh, size: dict, rounds: int) -> list[tuple[str, str]]:
    """Part 1: both forms, bit-identity on every step and time per step of both paths."""
    from pipeline.config import parse_config
    from pipeline.feed import expand
    from pipeline.feed.geometry import geometry
    from pipeline.read.plan import Plan

    out = []
    for packing in ("concat", "best_fit"):
        config = {
            **raw,
            "sources": {k: {**v, "packing": packing} for k, v in raw["sources"].items()},
        }
        plan = Plan.from_config(parse_config(config, origin="device_check"))
        place = geometry(mesh, ("data",), 1, size["rows"], size["seq_len"])

        def host(step: int, plan=plan, place=place) -> dict:
            return place.to_global(plan.read(plan.draws(step, place.rows)))

        def device(step: int, plan=plan, place=place) -> dict:
            return expand.to_global(place, plan.read_compact(plan.draws(step, place.rows)))

        steps = range(size["steps"] * rounds)
        identical = sum(same(host(s), device(s)) for s in steps)
        times = interleaved({"host": host, "device": device}, size["steps"], rounds)
        compact = plan.read_compact(plan.draws(0, place.rows))
        form = expand.WINDOWS if "tokens" in compact else expand.DOCUMENTS
        packed, _ = place.place([compact[n] for n in expand.NAMES[form]], [])
        build = expand.expander(form, place.sharding)
        alone = interleaved({"x": lambda _, f=build, p=packed: f(*p)}, size["steps"], rounds)["x"]
        (hw, hc), (dw, dc) = times["host"], times["device"]
        out += [
            (f"{packing}: expand: device equals expand: host, bit for bit (values, dtype, "
             "shape, sharding)", f"{identical} of {len(steps)} steps"),
            (f"{packing}: a step read + transferred, expand: host (six fields)",
             f"{hw:.2f} ms wall, {hc:.2f} ms CPU"),
            (f"{packing}: a step read + transferred + expanded, expand: device",
             f"{dw:.2f} ms wall, {dc:.2f} ms CPU ({hc / dc:.2f}x less CPU)"),
            (f"{packing}: the expansion alone on the device", f"{alone[0]:.3f} ms wall"),
        ]  # fmt: skip
        for store in plan.stores():
            store.close()
    return out


def link_limit(given: float | None, platform: str) -> tuple[float | None, str]:
    """The host-to-device link's one-direction GB/s limit and where it came from."""
    if given is not None:
        return given, "--link-gbs"
    if platform != "gpu":
        return None, "unknown (pass --link-gbs)"
    try:
        query = (
            "pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,pcie.link.width.current"
        )
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.splitlines()[0]  # fmt: skip
        gen, width, now_gen, now_width = (int(v) for v in line.split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, "unknown: nvidia-smi gave no PCIe link (pass --link-gbs)"
    limit = PCIE_GBS_PER_LANE.get(gen, 0.0) * width
    return limit, f"PCIe gen {gen} x{width} (now gen {now_gen} x{now_width}), nvidia-smi"


def bandwidth(mesh, size: dict, args: argparse.Namespace, raw: dict) -> list[tuple[str, str]]:
    """Part 2: device_put of one large buffer, and the feed's transfer of a step."""
    import jax

    from pipeline.config import parse_config
    from pipeline.feed import expand
    from pipeline.feed.geometry import geometry
    from pipeline.read.plan import Plan

    device = mesh.devices.flat[0]
    buffer = np.random.default_rng(0).integers(0, 255, size["bandwidth_mib"] << 20, np.uint8)
    jax.block_until_ready(jax.device_put(buffer, device))
    seconds = []
    for _ in range(5 if args.small else 20):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(buffer, device))
        seconds.append(time.perf_counter() - start)
    best, median = (
        buffer.nbytes / min(seconds) / 1e9,
        buffer.nbytes / statistics.median(seconds) / 1e9,
    )
    limit, source = link_limit(args.link_gbs, device.platform)
    share = f"{best / limit:.0%} of the link's {limit:.1f} GB/s" if limit else source
    plan = Plan.from_config(parse_config(raw, origin="device_check"))
    place = geometry(mesh, ("data",), 1, size["rows"], size["seq_len"])
    compact = plan.read_compact(plan.draws(0, place.rows))
    arrays = [compact[n] for n in expand.NAMES[expand.WINDOWS]]
    step_bytes = sum(a.nbytes for a in arrays)
    wall, _ = interleaved({"x": lambda _: place.place(arrays, [])}, size["steps"], 3)["x"]
    for store in plan.stores():
        store.close()
    return [
        (f"host -> device: jax.device_put of {size['bandwidth_mib']} MiB to one device",
         f"best {best:.1f} GB/s, median {median:.1f} GB/s ({share})"),
        ("the link's limit", source if limit is None else f"{limit:.1f} GB/s ({source})"),
        (f"the feed's transfer of a step's compact form ({step_bytes / 1024:,.0f} KiB, "
         f"{len(mesh.devices.flat)} devices)",
         f"{wall:.3f} ms, {step_bytes / wall / 1e6:.2f} GB/s"),
    ]  # fmt: skip


def training(raw: dict, mesh, size: dict, small: bool) -> list[tuple[str, str]]:
    """Part 3: the tiny LM, widened to a 50-200 ms step, on a fixed batch and on the feed."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tiny_lm import ModelConfig, init_params, make_train_step, optimizer

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed

    config = parse_config(raw, origin="device_check")
    replicated = NamedSharding(mesh, PartitionSpec())
    with DataFeed(config, mesh) as feed:
        fixed = jax.block_until_ready(next(feed))
        models = ((64, 1),) if small else MODELS
        for width, depth in models:  # bounded: the widest is the last
            model = ModelConfig(size["vocab"], size["seq_len"], width=width, depth=depth, heads=8)
            tx = optimizer(1e-4)
            params = jax.device_put(init_params(model, jax.random.key(0)), replicated)
            state = [params, tx.init(params)]
            step = make_train_step(model, tx)

            def train(batch: dict, state=state, step=step) -> object:
                state[0], state[1], metrics = step(state[0], state[1], batch)
                return metrics["loss"]

            jax.block_until_ready(train(fixed))
            ms = timed(lambda _: train(fixed), 3)[0]
            if ms >= STEP_MS[0]:
                break
        rows: dict[str, list[tuple[float, float, float]]] = {"fixed": [], "feed": []}
        for _ in range(size["train_rounds"]):
            for name in rows:
                waits = 0.0
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(size["train_steps"]):
                    entered = time.perf_counter()
                    batch = fixed if name == "fixed" else next(feed)
                    waits += time.perf_counter() - entered
                    jax.block_until_ready(train(batch))
                steps = size["train_steps"]
                rows[name].append(((time.perf_counter() - wall) / steps * 1e3,
                                   (time.process_time() - cpu) / steps * 1e3,
                                   waits / steps * 1e3))  # fmt: skip
        (fw, fc, _), (w, c, wait) = (
            tuple(statistics.median(v) for v in zip(*rows[n])) for n in ("fixed", "feed")
        )
    in_range = STEP_MS[0] <= fw <= STEP_MS[1]
    note = "" if in_range else f" (outside {STEP_MS[0]:.0f}-{STEP_MS[1]:.0f} ms: the fallback)"
    return [
        (f"training step of the tiny LM (width {width}, depth {depth}, {size['rows']} x "
         f"{size['seq_len']}), fixed batch", f"{fw:.1f} ms wall, {fc:.2f} ms CPU{note}"),
        ("the same step fed by DataFeed (expand: auto)",
         f"{w:.1f} ms wall, {c:.2f} ms CPU"),
        ("input-bound fraction: time in next() / step",
         f"{wait / w:.2%} ({wait:.3f} ms per step); wall {w / fw - 1:+.2%} over the fixed batch"),
        ("the feed's CPU per training step (fed less fixed)", f"{c - fc:+.2f} ms"),
    ]  # fmt: skip


def free_running(raw: dict, mesh, size: dict, rounds: int) -> list[tuple[str, str]]:
    """Part 4: process CPU per step of a free-running feed, and its next()'s thread CPU."""
    from pipeline.config import parse_config
    from pipeline.feed import expand
    from pipeline.feed.data_feed import DataFeed
    from pipeline.feed.geometry import geometry

    place = geometry(mesh, ("data",), 1, size["rows"], size["seq_len"])
    feeds, threads = {}, {}
    for mode in ("host", "device"):
        config = parse_config({**raw, "feed": {"expand": mode}}, origin="device_check")
        feed = DataFeed(config, mesh)
        threads[mode] = []

        def step(_: int, feed=feed, spent=threads[mode]) -> dict:
            start = time.thread_time()
            batch = next(feed)
            spent.append(time.thread_time() - start)
            return batch

        feeds[mode] = (feed, step)
    try:
        times = interleaved({m: s for m, (_, s) in feeds.items()}, size["steps"], rounds)
    finally:
        for feed, _ in feeds.values():
            feed.close()
    auto = "device" if expand.on_device("auto", place) else "host"
    tokens = size["rows"] * size["seq_len"]
    return [
        (f"DataFeed free-running, expand: {mode}" + (" (what auto picks here)" if mode == auto
         else ""), f"{cpu:.2f} ms process CPU per step ({cpu / tokens * 1e6:.1f} ns per token), "
         f"next() {statistics.median(threads[mode]) * 1e3:.3f} ms of the training thread")
        for mode, (_, cpu) in times.items()
    ]  # fmt: skip


def commit() -> str:
    try:
        command = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    import bench
    import jax
    from jax.sharding import Mesh

    size = sizes(args.small)
    rounds = args.rounds or size["rounds"]
    cache = args.cache_dir or bench.CACHE
    store = cache / f"device-check-{size['tokens']}-{size['vocab']}"
    if not (store / "manifest.json").exists():
        bench.synthetic_store(store, size["tokens"], 700, vocab_size=size["vocab"])
    raw = {"seed": 1, "seq_len": size["seq_len"], "global_batch_size": size["rows"],
           "sources": {"synthetic": {"path": str(store.resolve())}},
           "mix": {"synthetic": 1}}  # fmt: skip
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    started = time.perf_counter()
    results = []
    for part in (
        lambda: expansion(raw, mesh, size, rounds),
        lambda: bandwidth(mesh, size, args, raw),
        lambda: training(raw, mesh, size, args.small),
        lambda: free_running(raw, mesh, size, rounds),
    ):
        results += part()
        print(f"... {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    kind = f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    lines = [
        f"Device check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{kind}, JAX {jax.__version__}, commit {commit()}, {os.cpu_count()} CPUs, load "
        f"average {load}, {time.perf_counter() - started:.0f} s"
        + (" (CPU fallback: small batches, not an accelerator's figures)" if args.small else ""),
        "",
        "| measure | result |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in results),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
