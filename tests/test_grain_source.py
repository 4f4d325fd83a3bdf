"""Grain interoperability: the host's rows as a MapDataset, with Grain transforms chained on, in
Grain's worker processes (mp_prefetch, the DataLoader) and through Grain's checkpoints."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import flags
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, PipelineError, StoreError
from pipeline.feed.grain_source import host_dataset, host_source
from pipeline.plan.ledger import MixEntry, quantize
from pipeline.plan.resume import reconcile
from pipeline.plan.rows import host_rows
from pipeline.plan.sources import load_metas
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store
from tests.test_faults import replaced_line
from tests.test_plan import build, setups


def grain_raw(tmp_path, batch=4, seed=5) -> dict:
    """A two-source config over stores written under `tmp_path` (once)."""
    if not (tmp_path / "a").exists():
        write_synthetic_store(tmp_path / "a", [[40, 13, 22], [31, 9]])
        write_synthetic_store(tmp_path / "b", [[17, 50], [12, 12, 12]])
    return {
        "seed": seed, "seq_len": 6, "global_batch_size": batch, "lanes": 2,
        "sources": {"a": {"path": str(tmp_path / "a")}, "b": {"path": str(tmp_path / "b")}},
        "mix": {"a": 2, "b": 1},
    }  # fmt: skip


def make_plan(tmp_path, batch=4, seed=5) -> Plan:
    return Plan.from_config(parse_config(grain_raw(tmp_path, batch, seed), origin="grain.yaml"))


def test_a_batch_schedule_is_refused_in_favour_of_the_feed(tmp_path):
    plan = make_plan(tmp_path, batch={"step": {0: 4, 3: 8}})
    with pytest.raises(
        ConfigError, match=r"^grain\.yaml: global_batch_size is a schedule; the Grain "
    ):
        host_dataset(plan)


def test_map_dataset_elements_are_the_hosts_rows_in_step_order(tmp_path):
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, process_index=1, process_count=2, first_step=3, num_steps=5)
    assert len(dataset) == 5 * 2
    rows = host_rows(4, 1, 2)
    for index in (0, 1, 2, 9, 5):
        step, row = divmod(index, 2)
        expected = plan.batch(3 + step, rows[row : row + 1])
        for field, value in dataset[index].items():
            np.testing.assert_array_equal(value, expected[field][0])


def test_grain_transforms_chain_on_the_dataset(tmp_path):
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, num_steps=3).map(
        lambda example: {**example, "tokens_sum": int(example["inputs"].sum())}
    )
    batched = dataset.batch(4)
    first = batched[0]
    whole = plan.batch(0)
    np.testing.assert_array_equal(first["inputs"], whole["inputs"])
    assert first["tokens_sum"].tolist() == whole["inputs"].sum(axis=1).tolist()
    assert [element["tokens_sum"] for element in dataset.to_iter_dataset()][:4] == (
        whole["inputs"].sum(axis=1).tolist()
    )


def test_a_transform_cannot_write_into_a_row_and_change_its_other_fields(tmp_path):
    """`inputs` and `targets` are overlapping views of one buffer (so are the segment and the
    position pairs): writing a target in place would change an input. The fields are read-only;
    a transform that copies first changes only its copy."""
    plan = make_plan(tmp_path)
    dataset = host_dataset(plan, num_steps=2)

    def mask_first_target(example):
        example["targets"][0] = -1
        return example

    with pytest.raises(ValueError, match="read-only"):
        dataset.map(mask_first_target)[0]
    for field in plan.batch(0):
        with pytest.raises(ValueError, match="read-only"):
            plan.batch(0)[field][0, 0] = -1

    def copy_then_mask(example):
        example = {**example, "targets": example["targets"].copy()}
        example["targets"][0] = -1
        return example

    masked = dataset.map(copy_then_mask)[1]
    np.testing.assert_array_equal(masked["inputs"], plan.batch(0)["inputs"][1])
    assert masked["targets"][0] == -1 and plan.batch(0)["targets"][1, 0] != -1


def test_the_source_pickles_to_what_rebuilds_it_and_opens_stores_on_first_use(tmp_path):
    """What Grain sends a worker: the plan without its open stores or lock (a live plan
    cannot pickle); unpickled, it serves the same rows, opening the stores at the first read,
    and keeps its config's origin, the file that messages name."""
    plan = make_plan(tmp_path)
    plan.batch(0)  # stores open, shards read: none of it may travel
    copy = pickle.loads(pickle.dumps(host_source(plan, 1, 2, num_steps=4)))
    assert copy.plan is not plan and copy.plan.stores() == []
    assert copy.plan.config.origin == "grain.yaml" and copy.plan.ledger == plan.ledger
    for index in range(8):
        step, row = divmod(index, 2)
        for field, values in copy[index].items():
            np.testing.assert_array_equal(values, plan.batch(step, [2 + row])[field][0])
    assert {store.path for store in copy.plan.stores()} == {tmp_path / "a", tmp_path / "b"}
    twice = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(plan))))  # none laid out between
    assert twice.config.origin == "grain.yaml"
    dataset = pickle.loads(pickle.dumps(host_dataset(plan, num_steps=4).batch(4)))
    np.testing.assert_array_equal(dataset[3]["inputs"], plan.batch(3)["inputs"])


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(setups(sources=2), st.integers(0, 10**6), st.data())
def test_a_pickled_plan_gives_the_same_batches(setup, step, data):
    """Any plan, pickled after reads or before any: the same rows of any step, bit for bit."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = build(Path(tmp), setup, mix={"s0": 2, "s1": 1})
        if data.draw(st.booleans()):
            plan.batch(step)
        copy = pickle.loads(pickle.dumps(plan))
        size = setup["global_batch_size"]
        rows = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size))
        for chosen in (None, rows):
            expected = plan.batch(step, chosen)
            for field, values in copy.batch(step, chosen).items():
                np.testing.assert_array_equal(values, expected[field], err_msg=field)


def test_a_source_by_step_serves_the_hosts_rows_of_a_step_per_element(tmp_path):
    plan = make_plan(tmp_path)
    source = host_source(plan, process_index=0, process_count=2, first_step=2, num_steps=3,
                         by_step=True)  # fmt: skip
    assert len(source) == 3
    for index in range(3):
        for field, values in source[index].items():
            np.testing.assert_array_equal(values, plan.batch(2 + index, [0, 1])[field])
    with pytest.raises(IndexError, match=r"^step index 3 outside 0\.\.2$"):
        source[3]


def test_a_sources_repr_names_its_rows_and_data_order_the_same_in_any_process(tmp_path):
    """`grain.DataLoader` keeps `repr(source)` in its state and refuses a restore whose source
    differs: the same rows of the same data order must read the same, another order not."""
    plan = make_plan(tmp_path)
    source = host_source(plan, 1, 2, num_steps=5)
    again = host_source(pickle.loads(pickle.dumps(plan)), 1, 2, num_steps=5)
    assert (
        repr(source)
        == repr(again)
        == (
            f"HostRowSource(order={plan.ledger.last.fingerprint}, rows=[2, 3], first_step=0, "
            "num_steps=5, by_step=False)"
        )
    )
    other = make_plan(tmp_path / "other", seed=6)
    assert repr(host_source(other, 1, 2, num_steps=5)) != repr(source)
    steered = plan.with_mix(MixEntry(2, quantize({"a": 1.0, "b": 3.0})))  # other rows from 2
    assert repr(host_source(steered, 1, 2, num_steps=5)) != repr(source)


@pytest.mark.parametrize(("before", "after"), [(8, 4), (4, 8)])
def test_a_ledger_whose_batch_size_changed_is_refused_in_favour_of_the_feed(
    tmp_path, before, after
):
    """A host's rows are fixed in the Grain view: a switch that changed the batch size would
    leave rows unserved (8 -> 4) or index past a step's rows (4 -> 8); from a first step after
    the switch, the view serves."""
    first = make_plan(tmp_path, batch=before)
    raw = grain_raw(tmp_path, batch=after)
    switched = reconcile(first, parse_config(raw, origin="switched.yaml"), 3, switch=True)
    plan = Plan(switched, first.stores())
    with pytest.raises(
        ConfigError,
        match=rf": global_batch_size is {before} in ledger segment 0 \(from step 0\) and {after} "
        r"in the last; the Grain view serves a fixed number of rows per step",
    ):
        host_source(plan, 1, 2)
    source = host_source(plan, 1, 2, first_step=3, num_steps=2)
    rows = host_rows(after, 1, 2)
    np.testing.assert_array_equal(source[0]["inputs"], plan.batch(3, rows[:1])["inputs"][0])


def test_every_typed_error_crosses_a_process_boundary_as_itself():
    """Grain pickles a worker's exception and raises it again in the iterating process: each of
    ours must come back as its own type with its one line (a subclass whose constructor took
    other arguments would not unpickle)."""
    kinds = [PipelineError]
    for kind in kinds:
        kinds += kind.__subclasses__()
    assert StoreError in kinds and len(kinds) > 5
    for kind in kinds:
        error = kind("data.yaml: sources.code.path: /data/code: broken")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is kind and str(copy) == str(error)


# -- Grain's worker processes: mp_prefetch, the DataLoader, Grain's checkpoints -----------------

WORKER_WAIT_S = 120  # far above a tiny pipeline's seconds: only hung workers reach it


@pytest.fixture
def grain_workers() -> Iterator[None]:
    """What a script running Grain's workers needs outside an absl app: parsed absl flags
    (Grain 0.2.18 reads one when it starts a worker, google/grain#1355); and a bound, so that
    a hung worker fails the test instead of hanging it."""
    was_parsed = flags.FLAGS.is_parsed()
    flags.FLAGS.mark_as_parsed()

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"Grain's workers served nothing in {WORKER_WAIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(WORKER_WAIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if not was_parsed:
            flags.FLAGS.unparse_flags()


@contextmanager
def opened(dataset: grain.IterDataset) -> Iterator[grain.DatasetIterator]:
    """An iterator of `dataset`, closed after use: its worker processes stop."""
    iterator = iter(dataset)
    try:
        yield iterator
    finally:
        iterator.close()


def assert_batches(batches: list[dict], plan: Plan, first_step: int = 0) -> None:
    """`batches` are the plan's global batches of consecutive steps from `first_step`."""
    for step, batch in enumerate(batches, first_step):
        expected = plan.batch(step)
        assert set(batch) == set(expected)
        for field, values in batch.items():
            np.testing.assert_array_equal(values, expected[field], err_msg=f"{step} {field}")


def prefetched(plan: Plan, workers: int, steps: int = 6) -> grain.IterDataset:
    """The issue's recipe: one batch per step, in `workers` processes."""
    dataset = host_dataset(plan, num_steps=steps).batch(4).to_iter_dataset()
    return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


@pytest.mark.multiprocess  # Grain worker processes
@pytest.mark.parametrize("workers", [1, 2])
def test_mp_prefetch_workers_serve_the_plans_batches_and_resume_from_grains_state(
    tmp_path, grain_workers, workers
):
    """The source crosses into each worker and reads there; a restarted job (a new plan of
    the same config) resumes from Grain's state, through JSON as Grain's checkpoint keeps it."""
    plan = make_plan(tmp_path)
    with opened(prefetched(plan, workers)) as iterator:
        batches = [next(iterator), next(iterator)]
        state = json.loads(json.dumps(iterator.get_state()))
        batches += list(iterator)
    assert len(batches) == 6
    assert_batches(batches, plan)
    restarted = Plan.from_config(plan.config)
    with opened(prefetched(restarted, workers)) as iterator:
        iterator.set_state(state)
        assert_batches(list(iterator), plan, first_step=2)


@pytest.mark.multiprocess  # Grain worker processes
def test_map_and_filter_chains_run_in_the_workers(tmp_path, grain_workers):
    """Every row the filter keeps, once, mapped; in an order of Grain's, not the plan's: each
    worker filters its own slice of the indices and the workers take turns
    (`MapDataset.mp_prefetch`), so a filter after `mp_prefetch` keeps the plan's order."""
    plan = make_plan(tmp_path)
    dataset = (
        host_dataset(plan, num_steps=5)
        .map(lambda row: {"inputs": row["inputs"], "total": int(row["inputs"].sum())})
        .filter(lambda row: row["inputs"][0] % 2 == 0)
        .to_iter_dataset()
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    )
    with opened(dataset) as iterator:
        served = [(row["inputs"].tolist(), row["total"]) for row in iterator]
    rows = [inputs for step in range(5) for inputs in plan.batch(step)["inputs"].tolist()]
    expected = [(inputs, sum(inputs)) for inputs in rows if inputs[0] % 2 == 0]
    assert sorted(served) == sorted(expected) and 0 < len(expected) < len(rows)


def data_loader(plan: Plan, steps: int = 6) -> grain.DataLoader:
    """`host_source` by step in a DataLoader of 2 workers, in order."""
    source = host_source(plan, num_steps=steps, by_step=True)
    sampler = grain.samplers.IndexSampler(
        len(source), grain.sharding.NoSharding(), shuffle=False, num_epochs=1
    )
    return grain.DataLoader(data_source=source, sampler=sampler, worker_count=2)


@pytest.mark.multiprocess  # Grain worker processes
def test_a_data_loader_with_workers_serves_the_plans_batches_and_restores_in_a_new_loader(
    tmp_path, grain_workers
):
    """The DataLoader checks a restored state's source by its `repr`: the source's is the same
    for the same rows of a new plan of the config, so a restarted job's loader accepts it."""
    plan = make_plan(tmp_path)
    iterator = iter(data_loader(plan))
    batches = [next(iterator), next(iterator)]
    state = iterator.get_state()
    batches += list(iterator)
    assert len(batches) == 6
    assert_batches(batches, plan)
    restarted = iter(data_loader(Plan.from_config(plan.config)))
    restarted.set_state(state)
    assert_batches(list(restarted), plan, first_step=2)


@pytest.mark.multiprocess  # Grain worker processes
def test_grains_checkpoint_items_round_trip_the_iterator_in_an_orbax_manager(
    tmp_path, grain_workers
):
    plan = make_plan(tmp_path)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        with opened(prefetched(plan, workers=2)) as iterator:
            for _ in range(3):
                next(iterator)
            manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
            manager.wait_until_finished()
        with opened(prefetched(Plan.from_config(plan.config), workers=2)) as iterator:
            restore = ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator))
            manager.restore(manager.latest_step(), args=restore)
            assert_batches(list(iterator), plan, first_step=3)


def damage_document_indexes(store: Path) -> None:
    """Move a document boundary in every shard's index (the files keep their sizes)."""
    for docs in sorted(store.glob("shard-*.docs.npy")):
        values = np.load(docs)
        values[1] += 1
        np.save(docs, values)


@pytest.mark.multiprocess  # Grain worker processes
@pytest.mark.parametrize("damage", ["replaced", "damaged"])
def test_a_store_changed_under_the_workers_stops_them_with_the_parents_line(
    tmp_path, grain_workers, damage
):
    """A worker opens the stores itself, with the parent plan's checks: a store replaced since
    the ledger recorded it, or damaged, raises our typed error with the line the parent's own
    read gives, not a worker's traceback (the replaced one through mp_prefetch, the damaged
    one through the DataLoader)."""
    plan = make_plan(tmp_path)
    parent = Plan.from_config(plan.config, load_metas(plan.config))  # opens stores at a read
    store = tmp_path / "a"
    recorded = plan.ledger.last.fingerprints["a"]
    if damage == "replaced":
        shutil.rmtree(store)
        write_synthetic_store(store, [[41, 13, 22], [31, 9]])
        with pytest.raises(StoreError) as info, opened(prefetched(plan, workers=2)) as iterator:
            next(iterator)
        assert str(info.value) == replaced_line("grain.yaml: sources.a.path", store, recorded)
    else:
        damage_document_indexes(store)
        with pytest.raises(StoreError) as info:
            next(iter(data_loader(plan)))
        assert re.fullmatch(
            rf"grain\.yaml: sources\.a\.path: {store}/shard-0000\d-of-00002\.docs\.npy: does not "
            "match its checksum.*",
            str(info.value),
        )
    with pytest.raises(StoreError) as own:
        for step in range(6):
            parent.batch(step)
    assert str(info.value) == str(own.value) and "\n" not in str(info.value)
