"""The MaxText adapter on 4 forced CPU devices, with a MaxText-shaped config object."""

from __future__ import annotations

import enum
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import grain.python as grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipeline.config import load_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.feed import host_stop
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.maxtext import adapter
from pipeline.maxtext.adapter import (
    DataStop,
    EvalIterator,
    TrainIterator,
    batch_axes,
    create_data_iterator,
    is_enabled,
    read_iter_state,
)
from pipeline.plan.ledger import Ledger, MixEntry
from pipeline.read import objective
from pipeline.read.batch import FIELDS
from pipeline.read.eval_plan import eval_config
from pipeline.read.plan import Plan
from pipeline.store.token_store import MANIFEST
from tests.feedstores import two_stage_raw
from tests.storegen import write_synthetic_store


class DatasetType(str, enum.Enum):
    """As MaxText's pydantic config (configs/types.py) types `dataset_type`."""

    SYNTHETIC = "synthetic"
    GRAIN = "grain"


MAXTEXT_DATA_SHARDING = [
    ["data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert", "autoregressive"]
]  # the shape of MaxText's base.yml default: one entry, a list of axes


class MaxTextConfig:
    """Shaped like MaxText's pyconfig HyperParameters: attributes, ValueError if unknown."""

    def __init__(self, **keys: Any) -> None:
        object.__setattr__(self, "keys", keys)

    def __getattr__(self, attr: str) -> Any:
        if attr not in self.keys:
            raise ValueError(f"Requested key {attr}, not in config")
        return self.keys[attr]

    def __setattr__(self, attr: str, value: Any) -> None:
        raise ValueError


def maxtext_config(data_yaml: Path, **overrides: Any) -> MaxTextConfig:
    keys = {
        "dataset_type": "grain",
        "per_device_batch_size": 2.0,  # x 4 devices = 8 rows
        "max_target_length": 8,
        "data_sharding": MAXTEXT_DATA_SHARDING,
        "steps": 100,
        "eval_interval": 5,
        "eval_per_device_batch_size": 0.0,
        "expansion_factor_real_data": -1,
        "gradient_accumulation_steps": 1,
        "enable_data_shuffling": True,
        "pipeline_data_config": str(data_yaml),
    }
    keys.update(overrides)
    return MaxTextConfig(**keys)


def write_data_yaml(directory: Path, name: str = "data.yaml", **overrides: Any) -> Path:
    eval_store = directory / "heldout"
    if not eval_store.exists():
        write_synthetic_store(eval_store, [[40, 30, 50], [45, 35, 60]])
    raw = two_stage_raw(directory, eval={"sources": {"heldout": {"path": str(eval_store)}}})
    raw.update(overrides)
    path = directory / name
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert jax.device_count() >= 4, "tests/conftest.py forces 8 CPU devices"
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))


@pytest.fixture
def data_yaml(tmp_path: Path) -> Path:
    return write_data_yaml(tmp_path)


def host(batch: dict) -> dict[str, np.ndarray]:
    assert set(batch) == set(FIELDS)
    return {field: np.asarray(batch[field]) for field in FIELDS}


def assert_same(batch: dict, expected: dict) -> None:
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(batch[field]), expected[field], err_msg=field)


def close(*iterators: TrainIterator | EvalIterator | None) -> None:
    for iterator in iterators:
        if iterator is not None:
            iterator.close()


def test_train_batches_have_maxtexts_shape_sharding_and_the_plans_rows(
    data_yaml, mesh, monkeypatch
):
    monkeypatch.delenv("PIPELINE_DATA_CONFIG", raising=False)
    config = maxtext_config(data_yaml)
    assert is_enabled(config) and not is_enabled(MaxTextConfig(dataset_type="grain"))
    assert batch_axes(config, mesh) == ("data", "fsdp")
    plan = Plan.from_config(load_config(data_yaml))
    train, evals = create_data_iterator(config, mesh)
    try:
        sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
        for step in range(12):  # crosses the stage change at step 10
            batch = next(train)
            for field in FIELDS:
                assert batch[field].shape == (8, 8)
                assert batch[field].dtype == np.int32
                assert batch[field].sharding == sharding
            assert_same(batch, plan.batch(step))
            assert (np.asarray(batch["inputs_segmentation"]) >= 1).all()  # never padding
        assert train.step == 12
    finally:
        close(train, evals)


def test_state_round_trips_through_json_and_resumes_exactly(data_yaml, mesh):
    config = maxtext_config(data_yaml, eval_interval=-1)
    first, none = create_data_iterator(config, mesh)
    assert none is None
    try:
        for _ in range(6):
            next(first)
        state = first.local_iterator.get_state()
        assert state["step"] == 6
        as_dataset_iterator = json.loads(json.dumps(state, indent=4))  # Grain DatasetIterator path
        as_bytes = state.decode().encode()  # the path for any other iterator: bytes
        expected = [host(next(first)) for _ in range(8)]  # steps 6..13
    finally:
        first.close()
    for saved in (as_dataset_iterator, as_bytes):
        resumed, _ = create_data_iterator(config, mesh)
        try:
            resumed.local_iterator.set_state(saved)
            resumed.local_iterator.start_prefetch()  # Grain's handler calls it after set_state
            assert resumed.step == 6
            assert resumed.local_iterator.get_state() == state
            for batch in expected:
                assert_same(next(resumed), batch)
        finally:
            resumed.close()


def test_grains_checkpoint_handler_saves_and_restores_the_iter_item(data_yaml, mesh, tmp_path):
    config = maxtext_config(data_yaml, eval_interval=-1)
    train, _ = create_data_iterator(config, mesh)
    directory = tmp_path / "ckpt"
    try:
        for _ in range(3):
            next(train)
        with ocp.CheckpointManager(directory) as mngr:
            mngr.save(2, args=ocp.args.Composite(iter=grain.PyGrainCheckpointSave(
                train.local_iterator)))  # fmt: skip
            mngr.wait_until_finished()
        expected = [host(next(train)) for _ in range(3)]
    finally:
        train.close()
    saved = directory / "2" / "iter" / "process_0-of-1.json"
    assert json.loads(saved.read_text())["step"] == 3
    resumed, _ = create_data_iterator(config, mesh)
    try:
        with ocp.CheckpointManager(directory) as mngr:
            mngr.restore(2, args=ocp.args.Composite(iter=grain.PyGrainCheckpointRestore(
                resumed.local_iterator)))  # fmt: skip
        assert resumed.step == 3
        for batch in expected:
            assert_same(next(resumed), batch)
    finally:
        resumed.close()


def state_after_4_steps(config, mesh) -> tuple[str, dict]:
    """The iter item's text after 4 batches, and the 5th batch (host arrays)."""
    train, _ = create_data_iterator(config, mesh)
    try:
        for _ in range(4):
            next(train)
        return train.local_iterator.get_state().decode(), host(next(train))
    finally:
        train.close()


def test_any_processs_file_restores_after_a_host_count_change(data_yaml, mesh, tmp_path):
    config = maxtext_config(data_yaml, eval_interval=-1)
    text, expected = state_after_4_steps(config, mesh)
    item = tmp_path / "iter"
    item.mkdir()
    for index in (1, 0):  # as two processes wrote them; this run has one
        (item / f"process_{index}-of-2.json").write_text(text)
    assert read_iter_state(item).step == 4
    resumed, _ = create_data_iterator(config, mesh)
    try:
        resumed.restore_from(item)
        assert resumed.step == 4
        assert_same(next(resumed), expected)
    finally:
        resumed.close()
    with pytest.raises(LedgerError, match="process_"):
        read_iter_state(tmp_path)


@pytest.mark.parametrize(
    "files", [["process_0.json"], ["process_1-of-2.json", "process_0-of-2.json"]]
)
def test_the_cli_reads_the_ledger_of_a_maxtext_checkpoint_step(
    data_yaml, mesh, tmp_path, capsys, files
):
    """`--ledger CKPT/STEP` finds MaxText's `iter` item, in either layout, as it finds ours."""
    from pipeline.commands.cli import main

    text, _ = state_after_4_steps(maxtext_config(data_yaml, eval_interval=-1), mesh)
    step = tmp_path / "checkpoints" / "3"
    (step / "iter").mkdir(parents=True)
    for name in files:
        (step / "iter" / name).write_text(text)
    outputs = []
    for ledger in ([], ["--ledger", str(step)], ["--ledger", str(step / "iter")]):
        assert main(["inspect", str(data_yaml), "--step", "4", *ledger]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0].startswith("step 4: ") and outputs[1] == outputs[0] == outputs[2]
    assert main(["inspect", str(data_yaml), "--step", "4", "--ledger", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path}: no data/data_state.json or MaxText iter/process_0.json here (not a "
        "checkpoint step directory)"
    )


def test_restore_from_checks_the_step_exactly_by_maxtexts_numbering(data_yaml, mesh, tmp_path):
    """MaxText saves checkpoint N after training step N: `N/iter` holds data step N + 1."""
    config = maxtext_config(data_yaml, eval_interval=-1)
    text, _ = state_after_4_steps(config, mesh)
    for checkpoint in (3, 4):
        item = tmp_path / str(checkpoint) / "iter"
        item.mkdir(parents=True)
        (item / "process_0.json").write_text(text)
    resumed, _ = create_data_iterator(config, mesh)
    try:
        resumed.restore_from(tmp_path / "3" / "iter")
        assert resumed.step == 4
        with pytest.raises(LedgerError) as info:  # a state copied to the next checkpoint
            resumed.restore_from(tmp_path / "4" / "iter")
        assert str(info.value).splitlines()[1] == (
            "  step: 4 recorded in checkpoint 4, which holds step 5 (saved after training step 4: "
            "saved_after_step=True)"
        )
    finally:
        resumed.close()


def test_maxtext_takes_its_shared_state_path_for_our_iterator(data_yaml, mesh, tmp_path):
    """MaxText writes an ElasticIterator's state once, as process_0.json, from process 0, and
    every process of a later run, however many, reads it back (grain_utility's handler)."""
    from grain.experimental import ElasticIterator

    config = maxtext_config(data_yaml, eval_interval=-1)
    train, _ = create_data_iterator(config, mesh)
    try:
        assert isinstance(train.local_iterator, ElasticIterator)  # MaxText's dispatch test
        for _ in range(6):
            next(train)
        item = tmp_path / "iter"
        item.mkdir()
        (item / "process_0.json").write_text(json.dumps(train.local_iterator.get_state(), indent=4))
        expected = host(next(train))
    finally:
        train.close()
    for restore in ("set_state", "restore_from"):
        resumed, _ = create_data_iterator(config, mesh)
        try:
            if restore == "set_state":  # what MaxText's handler does with the file
                resumed.local_iterator.set_state(json.loads((item / "process_0.json").read_text()))
            else:
                resumed.restore_from(item)
            assert resumed.step == 6
            assert_same(next(resumed), expected)
        finally:
            resumed.close()


def state_after_12_steps(config, mesh) -> dict:
    """The iterator's state after 12 steps of `config`, through JSON as MaxText saves it."""
    train, _ = create_data_iterator(config, mesh)
    try:
        for _ in range(12):
            next(train)
        return json.loads(json.dumps(train.local_iterator.get_state()))
    finally:
        train.close()


def test_a_changed_data_config_needs_the_switch_key(data_yaml, mesh, tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_DATA_SWITCH", raising=False)
    config = maxtext_config(data_yaml, eval_interval=-1)
    state = state_after_12_steps(config, mesh)
    stages = [{"name": "main", "mix": {"code": 1, "docs": 3}}]
    changed = write_data_yaml(tmp_path, "changed.yaml", stages=stages)
    refused, _ = create_data_iterator(maxtext_config(changed, eval_interval=-1), mesh)
    try:
        flag = "declare the switch with pipeline_data_switch=true (or PIPELINE_DATA_SWITCH=true)"
        with pytest.raises(LedgerError, match=re.escape(flag)):
            refused.local_iterator.set_state(state)
    finally:
        refused.close()
    switched_config = maxtext_config(changed, eval_interval=-1, pipeline_data_switch=True)
    switched, _ = create_data_iterator(switched_config, mesh)
    try:
        switched.local_iterator.set_state(state)
        assert switched.step == 12
        assert len(switched.local_iterator.get_state()["ledger"]["segments"]) == 2
        next(switched)
    finally:
        switched.close()
    monkeypatch.setenv("PIPELINE_DATA_SWITCH", "true")  # the variable, for an undeclared key
    by_env, _ = create_data_iterator(maxtext_config(changed, eval_interval=-1), mesh)
    try:
        by_env.local_iterator.set_state(state)
        assert len(by_env.local_iterator.get_state()["ledger"]["segments"]) == 2
    finally:
        by_env.close()
    monkeypatch.setenv("PIPELINE_DATA_SWITCH", "maybe")
    with pytest.raises(ConfigError, match="PIPELINE_DATA_SWITCH='maybe': expected true or false"):
        create_data_iterator(maxtext_config(changed, eval_interval=-1), mesh)


def test_the_skip_key_or_variable_passes_over_steps_at_the_restore(
    data_yaml, mesh, tmp_path, monkeypatch
):
    monkeypatch.delenv("PIPELINE_DATA_SKIP", raising=False)
    config = maxtext_config(data_yaml, eval_interval=-1)
    plan = Plan.from_config(load_config(data_yaml))
    train, _ = create_data_iterator(config, mesh)
    try:
        for _ in range(12):
            next(train)
        item = tmp_path / "12" / "iter"  # MaxText's checkpoint 12 holds data step 13
        next(train)
        item.mkdir(parents=True)
        (item / "process_0.json").write_text(json.dumps(train.local_iterator.get_state()))
    finally:
        train.close()
    by_key = maxtext_config(data_yaml, eval_interval=-1, pipeline_data_skip=7)
    monkeypatch.setenv("PIPELINE_DATA_SKIP", "5")  # the key, when MaxText declares it, wins
    for skipping, skip in ((by_key, 7), (maxtext_config(data_yaml, eval_interval=-1), 5)):
        for restore in ("set_state", "restore_from"):
            resumed, _ = create_data_iterator(skipping, mesh)
            try:
                if restore == "set_state":
                    resumed.local_iterator.set_state(
                        json.loads((item / "process_0.json").read_text())
                    )
                else:
                    resumed.restore_from(item)
                assert resumed.step == 13
                assert_same(next(resumed), plan.batch(13 + skip))
                assert resumed.local_iterator.get_state()["ledger"]["segments"][1]["skip"] == skip
            finally:
                resumed.close()
    monkeypatch.setenv("PIPELINE_DATA_SKIP", "ten")
    with pytest.raises(ConfigError, match="PIPELINE_DATA_SKIP='ten': expected an integer >= 0"):
        create_data_iterator(maxtext_config(data_yaml, eval_interval=-1), mesh)


def test_mismatched_seq_len_or_batch_names_both_values(data_yaml, mesh):
    with pytest.raises(ConfigError, match=r"seq_len 8 != MaxText max_target_length 16"):
        create_data_iterator(maxtext_config(data_yaml, max_target_length=16), mesh)
    with pytest.raises(ConfigError, match=r"global_batch_size 8 != MaxText's global batch 4"):
        create_data_iterator(maxtext_config(data_yaml, per_device_batch_size=1.0), mesh)
    with pytest.raises(ConfigError, match=r"global_batch_size 8 != MaxText's global batch 16"):
        create_data_iterator(maxtext_config(data_yaml, global_batch_size_to_load=16), mesh)


def test_a_batch_schedule_is_refused_with_one_line(tmp_path, mesh):
    scheduled = write_data_yaml(tmp_path, "ramp.yaml", global_batch_size={"step": {0: 4, 5: 8}})
    with pytest.raises(ConfigError) as error:
        create_data_iterator(maxtext_config(scheduled), mesh)
    message = str(error.value)
    assert "ramp.yaml: global_batch_size is a schedule" in message and "\n" not in message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"expansion_factor_real_data": 2, "per_device_batch_size": 1.0}, "trains on 4"),
        ({"dataset_type": "tfds"}, "dataset_type tfds: set dataset_type=grain"),
        ({"data_sharding": [["data"], ["fsdp"]]}, "shards 2 dimensions"),
        ({"data_sharding": [["model"]]}, "names none of the mesh axes"),
        ({"pipeline_data_config": ""}, "pipeline_data_config"),
        ({"pipeline_eval_source": "nope"}, "'nope' (PIPELINE_EVAL_SOURCE) is not an eval source"),
        ({"dataset_type": DatasetType.SYNTHETIC}, "dataset_type synthetic: set dataset_type=grain"),
    ],
)
def test_bad_maxtext_settings_are_refused_before_any_step(
    data_yaml, mesh, overrides, message, monkeypatch
):
    monkeypatch.delenv("PIPELINE_DATA_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        create_data_iterator(maxtext_config(data_yaml, **overrides), mesh)
    assert "DatasetType" not in str(error.value)


def test_every_key_has_an_environment_variable(data_yaml, mesh, monkeypatch):
    """A MaxText that does not declare our keys reads them from the variables alone."""
    monkeypatch.setenv("PIPELINE_DATA_CONFIG", str(data_yaml))
    monkeypatch.setenv("PIPELINE_EVAL_SOURCE", "heldout")
    config = maxtext_config(data_yaml)
    del config.keys["pipeline_data_config"]
    assert is_enabled(config)
    train, evals = create_data_iterator(config, mesh)
    assert evals is not None and evals.name == "heldout"
    close(train, evals)
    monkeypatch.setenv("PIPELINE_EVAL_SOURCE", "nope")
    with pytest.raises(ConfigError, match=r"'nope' \(PIPELINE_EVAL_SOURCE\) is not an eval source"):
        create_data_iterator(config, mesh)


MAXTEXT_LOOP = """
import sys, threading, time
import jax, numpy as np
from jax.sharding import Mesh
from pipeline.maxtext.adapter import create_data_iterator
from tests.test_maxtext import maxtext_config
mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
train, _ = create_data_iterator(maxtext_config(sys.argv[1], eval_interval=-1), mesh)
next(train)
print("serving", flush=True)
sys.stdin.readline()  # the store is replaced now
# a thread the interpreter waits for at exit, as Orbax's checkpoint finalize waiting on a peer
threading.Thread(target=threading.Event().wait).start()
try:  # MaxText's loop: any Exception of next() ends the run "gracefully", exit status 0
    while True:
        next(train)
        time.sleep(0.01)
except Exception as error:
    print(f"Training stopped: {error}", flush=True)
"""


def test_a_data_error_ends_maxtexts_loop_with_status_2_and_its_line(tmp_path):
    """MaxText catches every `Exception` of `next(data_iterator)` and ends the run with
    "Training stopped" and exit status 0 (data_loader.py's `loader_exception_guard`); a store
    replaced under the run must end the process with status 2 and the line, even when a
    non-daemon thread would keep the interpreter alive."""
    from tests.test_faults import corpus

    store = tmp_path / "store"

    def prepare_store(words: str, overwrite: bool) -> None:
        texts = corpus(tmp_path / words, words, 60)
        prepare(PrepareOptions([str(texts)], store, num_shards=1, overwrite=overwrite,
                               progress=False))  # fmt: skip

    prepare_store("alpha", overwrite=False)
    raw = {"seed": 3, "seq_len": 8, "global_batch_size": 8, "sources": {"s": {"path": str(store)}}}
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({**raw, "mix": {"s": 1}}))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parent.parent))
    env.update({host_stop.STORE_CHECK_ENV: "0.05", host_stop.GRACE_ENV: "1"})
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    child = subprocess.Popen(
        [sys.executable, "-c", MAXTEXT_LOOP, str(tmp_path / "data.yaml")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "serving\n", child.stderr.read()
        prepare_store("omega", overwrite=True)
        out, err = child.communicate("\n", timeout=60)
    finally:
        child.kill()
    line = (
        f"error: {tmp_path / 'data.yaml'}: sources.s.path: {store / MANIFEST}: the store was "
        "replaced or changed after it was opened (by `prepare --overwrite`?); restart the job "
        "to read the new store"
    )
    assert child.returncode == 2, err
    assert "Training stopped" not in out
    assert err.strip().splitlines()[-1].endswith(line), err


def test_pydantic_enum_dataset_type_is_accepted(data_yaml, mesh):
    train, evals = create_data_iterator(
        maxtext_config(data_yaml, dataset_type=DatasetType.GRAIN), mesh
    )
    close(train, evals)


def test_a_vocab_size_below_a_stores_vocabulary_is_refused(tmp_path, mesh):
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    prepare(PrepareOptions([str(text)], tmp_path / "bytes", num_shards=1, progress=False))
    raw = {
        "seed": 1,
        "seq_len": 8,
        "global_batch_size": 8,
        "sources": {"text": {"path": str(tmp_path / "bytes")}},
        "mix": {"text": 1},
    }
    path = tmp_path / "bytes.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as error:
        create_data_iterator(maxtext_config(path, eval_interval=-1, vocab_size=128), mesh)
    assert str(error.value) == (
        f"MaxText config: vocab_size 128 is smaller than the vocabulary of the store "
        f"{tmp_path / 'bytes'} (257 ids); set vocab_size=257 or more"
    )
    train, _ = create_data_iterator(maxtext_config(path, eval_interval=-1, vocab_size=257), mesh)
    train.close()


def test_data_config_grad_accum_is_left_to_maxtext(tmp_path, mesh):
    path = write_data_yaml(tmp_path, grad_accum=2)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2"):
        create_data_iterator(maxtext_config(path), mesh)


def test_eval_without_an_eval_section_is_refused(tmp_path, mesh):
    raw = two_stage_raw(tmp_path)
    path = tmp_path / "no-eval.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="no 'eval:' section"):
        create_data_iterator(maxtext_config(path), mesh)
    train, evals = create_data_iterator(maxtext_config(path, eval_interval=-1), mesh)
    assert evals is None
    train.close()


def test_eval_iterator_repeats_after_reset(tmp_path, mesh):
    path = write_data_yaml(tmp_path)
    data = load_config(path)
    expected_plan = Plan.from_config(eval_config(data, data.eval_sources[0]))
    train, evals = create_data_iterator(maxtext_config(path), mesh)
    try:
        windows = expected_plan.segment_plan(0).layouts["heldout"].windows_per_lane
        assert evals is not None and evals.name == "heldout"
        assert evals.batches == windows // 8 >= 2
        first = [host(batch) for batch in evals]
        assert len(first) == evals.batches
        for step, batch in enumerate(first):
            assert_same(batch, expected_plan.batch(step))
        next(train)  # training in between changes nothing
        evals.reset()
        second = [host(next(evals)) for _ in range(evals.batches)]
        with pytest.raises(StopIteration):
            next(evals)
        evals.reset()
        third = [host(batch) for batch in evals]
        for a, b, c in zip(first, second, third):
            for field in FIELDS:
                np.testing.assert_array_equal(a[field], b[field])
                np.testing.assert_array_equal(a[field], c[field])
    finally:
        close(train, evals)


def test_eval_batch_follows_eval_per_device_batch_size(tmp_path, mesh):
    path = write_data_yaml(tmp_path)
    data = load_config(path)
    windows = (
        Plan.from_config(eval_config(data, data.eval_sources[0]))
        .segment_plan(0)
        .layouts["heldout"]
        .windows_per_lane
    )
    config = maxtext_config(path, eval_per_device_batch_size=1.0)
    train, evals = create_data_iterator(config, mesh)
    try:
        batch = next(iter(evals))
        assert batch["inputs"].shape == (4, 8)
        assert batch["inputs"].sharding == NamedSharding(
            mesh, PartitionSpec(("data", "fsdp"), None)
        )
        assert evals.batches == windows // 4
    finally:
        close(train, evals)


def test_the_data_configs_feed_section_turns_on_provenance(tmp_path, mesh):
    data_yaml = write_data_yaml(tmp_path, feed={"provenance": ["source"]})
    plan = Plan.from_config(load_config(data_yaml))
    train, evals = create_data_iterator(maxtext_config(data_yaml), mesh)
    try:
        for step in range(3):
            batch = next(train)
            assert set(batch) == {*FIELDS, "source"}
            assert_same(batch, plan.batch(step))
            np.testing.assert_array_equal(np.asarray(batch["source"]), plan.draws(step).source)
            assert batch["source"].sharding == NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        assert all(set(b) == set(FIELDS) for b in evals)  # eval batches stay six fields
    finally:
        close(train, evals)


def test_the_train_iterator_passes_the_objectives_loss_weights_on(tmp_path, mesh):
    """docs/mixtures.md, "Objective weights": the batch MaxText gets carries `loss_weights`,
    sharded as the fields, the step's weights."""
    data_yaml = write_data_yaml(tmp_path, objective={"code": 1, "docs": 3})
    plan = Plan.from_config(load_config(data_yaml))
    train, evals = create_data_iterator(maxtext_config(data_yaml), mesh)
    try:
        for step in range(3):
            batch = next(train)
            assert set(batch) == {*FIELDS, "loss_weights"}
            weights = objective.step_weights(plan, step)
            np.testing.assert_array_equal(np.asarray(batch["loss_weights"]), weights)
            assert batch["loss_weights"].sharding == batch["targets"].sharding
        assert all(set(b) == set(FIELDS) for b in evals)  # held-out batches: no objective
    finally:
        close(train, evals)


def test_the_train_iterator_sets_the_mix_in_the_state_maxtext_saves(data_yaml, mesh):
    plan = Plan.from_config(load_config(data_yaml))
    train, _ = create_data_iterator(maxtext_config(data_yaml, eval_interval=-1), mesh)
    try:
        next(train)
        train.set_mix({"docs": 1}, step=train.step)
        state = train.local_iterator.get_state()
        expected = plan.with_mix(MixEntry(1, (("docs", 2**20),)))
        assert Ledger.from_json(state["ledger"]) == expected.ledger
        assert_same(next(train), expected.batch(1))
    finally:
        train.close()
    resumed, _ = create_data_iterator(maxtext_config(data_yaml, eval_interval=-1), mesh)
    try:
        resumed.local_iterator.set_state(json.loads(json.dumps(state)))
        assert_same(next(resumed), expected.batch(1))
    finally:
        resumed.close()


def test_a_switch_to_a_longer_seq_len_and_more_lanes_through_the_switch_key(
    data_yaml, mesh, tmp_path, monkeypatch
):
    """Context extension in MaxText: seq_len 8 -> 16 (with max_target_length), lanes 2 -> 4,
    declared with pipeline_data_switch=true: the restored iterator serves the switched plan."""
    from pipeline.plan.resume import reconcile

    monkeypatch.delenv("PIPELINE_DATA_SWITCH", raising=False)
    state = state_after_12_steps(maxtext_config(data_yaml, eval_interval=-1), mesh)
    longer = write_data_yaml(tmp_path, "long.yaml", seq_len=16, lanes=4)
    keys = {"eval_interval": -1, "max_target_length": 16, "pipeline_data_switch": True}
    switched, _ = create_data_iterator(maxtext_config(longer, **keys), mesh)
    run = Plan.from_config(load_config(data_yaml))
    plan = Plan(reconcile(run, load_config(longer), 12, switch=True), run.stores())
    try:
        switched.local_iterator.set_state(state)
        assert switched.step == 12
        for step in (12, 13):
            assert_same(next(switched), plan.batch(step))
        assert switched.local_iterator.get_state()["ledger"]["version"] == 6
    finally:
        switched.close()


def test_a_take_down_through_the_switch_key_serves_no_excluded_token(mesh, tmp_path, monkeypatch):
    """Take-down in MaxText: restored with pipeline_data_switch=true and a data config whose
    sources gained `exclude: FILE`, the iterator serves the switched plan, in which no row holds
    a token of a document its source takes down (every token of these stores is distinct), and
    the state MaxText saves records the file."""
    from pipeline.plan.resume import reconcile
    from pipeline.store.token_store import TokenStore
    from tests.feedstores import excluding_raw, geometry_raw

    monkeypatch.delenv("PIPELINE_DATA_SWITCH", raising=False)
    before, after = tmp_path / "data.yaml", tmp_path / "taken.yaml"
    before.write_text(yaml.safe_dump(geometry_raw(tmp_path)))
    after.write_text(yaml.safe_dump(excluding_raw(tmp_path)))
    taken = {}
    for name in ("web", "chat"):
        ids = re.findall(r"s(\d+)-d(\d+)", (tmp_path / f"takedown-{name}.txt").read_text())
        store = TokenStore(tmp_path / name)
        taken[name] = np.concatenate([store.document(int(s), int(d)) for s, d in ids])

    def excluded_rows(batch: dict, draws) -> list[tuple[int, str]]:
        rows = []
        for row, source in enumerate(draws.source.tolist()):
            name = draws.source_names[source]
            tokens = batch["inputs"][row][batch["inputs_segmentation"][row] > 0]
            if np.isin(tokens, taken[name]).any():
                rows.append((row, name))
        return rows

    keys = {"eval_interval": -1, "per_device_batch_size": 1.0, "max_target_length": 32}
    state = state_after_12_steps(maxtext_config(before, **keys), mesh)
    run = Plan.from_config(load_config(before))
    steps = range(12, 24)
    # without the take-down, these steps would serve some of the documents
    assert any(excluded_rows(run.batch(step), run.draws(step)) for step in steps)
    plan = Plan(reconcile(run, load_config(after), 12, switch=True), run.stores())
    switched, _ = create_data_iterator(
        maxtext_config(after, pipeline_data_switch=True, **keys), mesh
    )
    try:
        switched.local_iterator.set_state(state)
        assert switched.step == 12
        for step in steps:
            batch = host(next(switched))
            assert_same(batch, plan.batch(step))
            assert excluded_rows(batch, plan.draws(step)) == [], step
        saved = switched.local_iterator.get_state()["ledger"]["segments"][-1]["config"]
        assert saved["sources"]["web"]["exclude"]["file"] == str(tmp_path / "takedown-web.txt")
    finally:
        switched.close()


def test_the_skip_at_key_skips_once_at_its_step_whichever_checkpoint_restores(
    data_yaml, mesh, tmp_path, monkeypatch
):
    """pipeline_data_skip=3 with pipeline_data_skip_at=12, repeated by every restart: from
    MaxText's checkpoints before step 12 (with and without the skip scheduled), at it and past
    it (holding the skip), and from none at all (the first launch of a loop), every step is
    the plan's that skips 3 steps at step 12 once; past it without the skip, one line."""
    from pipeline.plan.resume import reconcile

    monkeypatch.delenv("PIPELINE_DATA_SKIP", raising=False)
    monkeypatch.delenv("PIPELINE_DATA_SKIP_AT", raising=False)
    config = maxtext_config(data_yaml, eval_interval=-1)
    data = load_config(data_yaml)
    plan = Plan.from_config(data)
    skipped = Plan(reconcile(plan, data, 12, skip=3), plan.stores())
    keys = maxtext_config(
        data_yaml, eval_interval=-1, pipeline_data_skip=3, pipeline_data_skip_at=12
    )
    states: dict[str, dict] = {}

    def run(restore: str | None, first: int, stop: int, cfg=keys) -> None:
        """Restore `states[restore]` (None: nothing), serve steps first..stop - 1, keeping
        the state before each step as states[f"{step}"] (MaxText's checkpoint step - 1)."""
        train, _ = create_data_iterator(cfg, mesh)
        try:
            if restore is not None:
                train.local_iterator.set_state(json.loads(json.dumps(states[restore])))
            for step in range(first, stop):
                states[f"{step}"] = dict(train.local_iterator.get_state())
                reference = skipped if cfg is keys else plan
                assert_same(next(train), reference.batch(step))
        finally:
            train.close()

    run(None, 0, 14, cfg=config)  # a run without the keys: step 13 holds no skip
    unskipped = {key: states[key] for key in ("8", "12", "13")}
    run("8", 8, 11)  # before step 12: scheduled; the state of step 10 holds it
    run("10", 10, 14)  # before it, holding it scheduled
    run("13", 13, 16)  # past it, holding it: nothing more
    run("12", 12, 14)  # at it, holding it
    states["12"] = unskipped["12"]
    run("12", 12, 15)  # at it, without it: made there
    run(None, 0, 15)  # no checkpoint (a loop's first launch): scheduled from step 0
    ledger = Ledger.from_json(states["14"]["ledger"])
    assert [(s.start_step, s.skip) for s in ledger.segments] == [(0, 0), (12, 3)]
    train, _ = create_data_iterator(keys, mesh)
    try:
        with pytest.raises(LedgerError) as refused:
            train.local_iterator.set_state(unskipped["13"])
    finally:
        train.close()
    assert str(refused.value).startswith(
        "skip_at 12: the restored step 13 is past it and the checkpoint's ledger holds no skip "
        "there"
    )
    with pytest.raises(ConfigError, match="pipeline_data_skip_at=12: without pipeline_data_skip"):
        create_data_iterator(maxtext_config(data_yaml, pipeline_data_skip_at=12), mesh)


def test_a_skip_without_a_restored_checkpoint_stops_at_the_first_batch(
    data_yaml, mesh, monkeypatch
):
    """pipeline_data_skip on a run MaxText starts from scratch (no checkpoint found) would
    skip nothing and train from step 0 as if asked to: the first next() stops it instead."""
    monkeypatch.delenv("PIPELINE_DATA_SKIP", raising=False)
    lines = []
    monkeypatch.setattr(adapter, "end_process_after", lines.append)
    train, _ = create_data_iterator(
        maxtext_config(data_yaml, eval_interval=-1, pipeline_data_skip=4), mesh
    )
    try:
        with pytest.raises(DataStop) as stopped:
            next(train)
    finally:
        train.close()
    assert lines == [f"error: {stopped.value}"]
    assert str(stopped.value) == (
        "pipeline_data_skip=4: no checkpoint was restored, so there is no step to skip from; "
        "give it only to a run that resumes from a checkpoint, or name the step with "
        "pipeline_data_skip_at"
    )
