"""The compiled assembly of benchmarks/native_ab.py gives the Python path's batches, bit for bit.

`benchmarks/native_read.py` (numba, not adopted: docs/benchmarks-history.md) is swapped into
the read path (`pipeline.read.windows._assemble`) and compared, every field of the six and of
the compact form, with the Python path over hypothesis-drawn stores and plans: several sources
(uint32 and uint16 sidecars, loss masks, a best-fit source beside them), lanes, steps; a
flipped byte in a sidecar is refused by it as by the Python path.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, StoreError
from pipeline.read import windows
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store
from tests.test_checked_reads import flip, masked_store, middle_offsets
from tests.test_packing import write_masked_store

ROOT = Path(__file__).resolve().parents[1]
PYTHON = windows._assemble


@pytest.fixture(scope="module")
def native_read(tmp_path_factory):
    """benchmarks/native_read.py, imported as benchmarks/native_ab.py imports it (numba's
    compile cache is of one module name), its compile cache in a temporary directory instead of
    the checkout's benchmarks/__pycache__."""
    from numba.core import config

    saved, config.CACHE_DIR = config.CACHE_DIR, str(tmp_path_factory.mktemp("numba-cache"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("native_read")  # its functions' cache paths set now
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        config.CACHE_DIR = saved


@pytest.fixture
def compiled(monkeypatch, native_read):
    """`native_ab`'s compiled assembly in the read path; `PYTHON` restored after the test."""
    monkeypatch.setattr(windows, "_assemble", PYTHON)
    native_read.use()
    assert windows._assemble is not PYTHON
    return windows._assemble


def both(plan: Plan, step: int, compiled) -> list[tuple[dict, dict]]:
    """Step `step` read by the Python path and the compiled one, six fields and compact."""
    pairs = []
    for read in (plan.read, plan.read_compact):
        draws = plan.draws(step)
        windows._assemble = PYTHON
        python = read(draws)
        windows._assemble = compiled
        pairs.append((python, read(draws)))
    return pairs


def assert_same(python: dict | None, native: dict | None) -> None:
    assert (python is None) == (native is None)
    if python is None:
        return
    assert python.keys() == native.keys()
    for name, values in python.items():
        assert values.dtype == native[name].dtype, name
        assert values.shape == native[name].shape, name
        assert np.array_equal(values, native[name]), name


lengths = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    plain=st.lists(st.lists(lengths, min_size=1, max_size=3), min_size=1, max_size=3),
    masked=st.lists(
        st.lists(st.tuples(st.integers(2, 30), st.integers(0, 8), st.integers(0, 3)), min_size=1),
        min_size=0,
        max_size=2,
    ),
    best_fit=st.booleans(),
    seq_len=st.integers(2, 24),
    lanes=st.sampled_from([1, 2]),
    seed=st.integers(0, 3),
)
def test_the_compiled_assembly_gives_the_python_batches(
    tmp_path_factory, compiled, plain, masked, best_fit, seq_len, lanes, seed
) -> None:
    """Windows of plain (uint32) and masked stores, mixed, with a best-fit source beside them
    (its rows read in Python, the windows' compiled), over several steps and lanes."""
    root = tmp_path_factory.mktemp("native")
    sources, mix = {}, {}
    for i, shards in enumerate(plain):
        sources[f"plain{i}"] = {"path": str(write_synthetic_store(root / f"p{i}", shards).path)}
    if masked:
        store = write_masked_store(root / "masked", masked)
        sources["masked"] = {"path": str(store.path)}
        if best_fit:
            sources["fit"] = {"path": str(store.path), "packing": "best_fit",
                              "too_long": "truncate"}  # fmt: skip
    mix = {name: i + 1 for i, name in enumerate(sources)}
    raw = {"seed": seed, "seq_len": seq_len, "global_batch_size": 8, "lanes": lanes,
           "sources": sources, "mix": mix}  # fmt: skip
    try:
        plan = Plan.from_config(parse_config(raw, origin="native.yaml"))
    except ConfigError:  # too few windows for a batch: nothing to compare
        return
    for step in (0, 1, 7, 30):
        for python, native in both(plan, step, compiled):
            assert_same(python, native)


def test_uint16_sidecars_and_a_flipped_byte(tmp_path: Path, compiled) -> None:
    """A uint16 store of small checked blocks: every step the same on both paths; a byte
    flipped in a copy's sidecar is refused by the compiled path with the Python path's error,
    at the same step."""

    def plan(store: Path) -> Plan:
        raw = {"seed": 1, "seq_len": 63, "global_batch_size": 8,
               "sources": {"code": {"path": str(store)}}, "mix": {"code": 1}}  # fmt: skip
        return Plan.from_config(parse_config(raw, origin="native.yaml"))

    checked = plan(masked_store(tmp_path / "store"))
    for step in range(12):
        for python, native in both(checked, step, compiled):
            assert_same(python, native)
    errors = refusals(tmp_path, plan, (PYTHON, compiled))
    assert errors[0] == errors[1]
    assert "do not match their block checksums" in errors[0][1]


def refusals(
    tmp_path: Path, plan: Callable[[Path], Plan], assembles: tuple[Callable, ...]
) -> list[tuple[int, str]]:
    """The step and the error at which each of `assembles` (`windows._assemble`) refuses a
    masked store with a byte flipped in a block of a sidecar."""
    damaged = masked_store(tmp_path / "damaged")
    sidecar = damaged / "shard-00001-of-00002.flat.bin"
    flip(sidecar, middle_offsets(sidecar, 2)["high"])
    errors = []
    for assemble in assembles:
        windows._assemble = assemble
        fresh = plan(damaged)
        with pytest.raises(StoreError) as error:
            for step in range(40):
                fresh.read(fresh.draws(step))
        errors.append((step, str(error.value)))
    return errors


def test_pieces_it_does_not_serve_are_read_in_python(tmp_path: Path, compiled, native_read) -> None:
    """A store read through ArrayRecord (no flat sidecar): `assemble` declines, the Python
    path reads, the same batch."""
    store = write_synthetic_store(tmp_path / "s", [[30, 50], [40]], record_tokens=16, flat=False)
    raw = {"seed": 2, "seq_len": 9, "global_batch_size": 4,
           "sources": {"s": {"path": str(store.path)}}, "mix": {"s": 1}}  # fmt: skip
    plan = Plan.from_config(parse_config(raw, origin="native.yaml"))
    draws = plan.draws(0)
    segment = plan.segment_plan(draws.segment_index)
    layouts = segment.ordered_layouts
    stores = [plan.store_set.open(layouts[0].meta)]
    pieces = windows.window_pieces(layouts, np.zeros(4, np.int64), draws.epoch, draws.start)
    tokens = np.empty((4, 10), np.int32)
    assert native_read.assemble(stores, *pieces, tokens, packed=False) is None
    for python, native in both(plan, 0, compiled):
        assert_same(python, native)


def test_the_compile_cache_is_written_outside_the_checkout(native_read) -> None:
    """numba caches the compiled functions beside their module by default: under
    benchmarks/__pycache__ of the checkout, which the tests must leave as they found it."""
    compiled = [native_read._assemble, native_read._copy, native_read._unchecked]
    paths = [Path(function._cache._cache_path) for function in compiled]
    assert not any(path.is_relative_to(ROOT) for path in paths), paths
