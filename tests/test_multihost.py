"""Real multi-process JAX on localhost: the feed and the checkpoint across hosts and restarts.

Each launch starts N `tests/multihost_worker.py` processes (JAX_PLATFORMS=cpu, K forced devices
each) joined by `jax.distributed.initialize` on 127.0.0.1. Expectations come from the
single-process `Plan.batch` computed here (and the model value its batches add up to).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.plan.ledger import Ledger
from pipeline.read import objective
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_raw
from tests.storegen import arrayrecord_only

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
STEPS = [0, 7, 10, 23, 1000]  # epoch rollovers, the stage change at 10, a far step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, raw: dict, tasks: list[dict], processes: int, devices: int,
           timeout: float = 120, nofile: int | None = None) -> list[int]:  # fmt: skip
    """Run one job to the end (or its self-kill); returns the exit codes. `nofile`: every
    process's open-file limit, soft and hard."""
    spec = {"port": free_port(), "n": processes, "config": raw, "out": str(tmp), "tasks": tasks}
    spec["nofile"] = nofile
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    logs = [open(tmp / f"{path.stem}-{i}.log", "w") for i in range(processes)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multihost_worker", str(path), str(i)],
            cwd=ROOT,
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
        for log in logs:
            log.close()
    return codes


def worker_output(tmp: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp.glob("spec-*-*.log")))


def reference_checksums(batch: dict[str, np.ndarray]) -> np.ndarray:
    total = np.zeros(batch["inputs"].shape[0], dtype=np.int64)
    for index, field in enumerate(FIELDS):
        weights = np.arange(1, batch[field].shape[-1] + 1) * (index + 1)
        total += (batch[field].astype(np.int64) * weights).sum(-1)
    return total.astype(np.int32)


@pytest.mark.parametrize(
    ("processes", "devices", "meshes", "flat"),
    [
        (2, 2, [([4], ["data"], ["data"]), ([2, 2], ["data", "fsdp"], ["data", "fsdp"])], True),
        (2, 2, [([4], ["data"], ["data"])], False),
        (4, 1, [([4], ["data"], ["data"]), ([2, 2], ["fsdp", "data"], ["data", "fsdp"])], True),
    ],
)
def test_global_batches_across_processes_equal_the_plan(tmp_path, processes, devices, meshes, flat):
    """Every field of several steps equals ArrayRecord's plan, with stores with flat sidecars
    (the feed's fast path) and without."""
    raw = two_stage_raw(tmp_path / "stores", flat=flat)
    tasks = [
        {
            "kind": "checksums",
            "name": f"mesh{i}",
            "mesh": [shape, names],
            "batch_axes": axes,
            "steps": STEPS,
        }
        for i, (shape, names, axes) in enumerate(meshes)
    ]
    tasks.append({"kind": "open", "missing_on": processes - 1})
    tasks.append({"kind": "disagree", "odd_one": processes - 1})
    tasks.append({"kind": "disagree", "odd_one": processes - 1, "skip": True, "name": "skip"})
    codes = launch(tmp_path, raw, tasks, processes, devices)
    assert codes == [0] * processes, worker_output(tmp_path)
    plan = arrayrecord_only(Plan.from_config(parse_config(raw, origin="multihost.yaml")))
    for i in range(len(meshes)):
        result = np.load(tmp_path / f"mesh{i}.npz")
        for step in STEPS:
            expected = plan.batch(step)
            for field in FIELDS:
                np.testing.assert_array_equal(result[f"{field}_{step}"], expected[field])
            np.testing.assert_array_equal(result[f"checksum_{step}"], reference_checksums(expected))
    # A store missing on one host stops every host with a clear error instead of a hang.
    for index in range(processes):
        message = (tmp_path / f"open-{index}.txt").read_text()
        if index == processes - 1:
            assert message.startswith("ConfigError: multihost.yaml: sources.")
            assert "no-such-store" in message
        else:
            assert message == (
                f"FeedError: multihost.yaml: process(es) [{processes - 1}] cannot open the data "
                "(see their logs); every process stops before the first step"
            )
    # Hosts that restore different data states, or skip differently, all refuse, naming the
    # odd one out (a host that skipped alone would serve its rows of another plan step).
    for index, name in itertools.product(range(processes), ("disagree", "skip")):
        assert (tmp_path / f"{name}-{index}.txt").read_text() == (
            f"LedgerError: data_state.json: processes [{processes - 1}] read a different data "
            "state, run a different data config, or declare a different switch or skip than "
            "process 0; every host must restore the same checkpoint with the same config file "
            "and the same flags"
        )


RAMP_STEPS = [0, 4, 5, 11, 12, 30, 7]  # each reached by a seek, as a resumed run reaches it
ONE_MESH = {  # the one-mesh checksums tests: (steps, [(processes, devices each)])
    "ramp": (RAMP_STEPS, [(1, 4), (2, 2), (4, 1)]),
    "prov": (STEPS, [(1, 4), (2, 2)]),
    "sft": (STEPS, [(2, 2), (4, 1)]),
    "objective": (STEPS, [(1, 4), (2, 2)]),
    "objective-device": (STEPS, [(1, 4), (2, 2)]),
    "objective-switch": (STEPS, [(1, 4), (2, 2)]),
}
SWITCH_AT = 8  # "objective-switch": its ledger switches the objective of "objective" here
PROVENANCE = ["source", "epoch", "window"]


def one_mesh_raws(stores: Path) -> dict[str, dict]:
    """The configs of the one-mesh tests, by task name: a batch ramp, provenance fields with
    gradient accumulation, and best_fit rows of a masked store mixed with windows."""
    from tests.test_packing import write_masked_store

    base = two_stage_raw(stores)
    sft = write_masked_store(stores / "sft", [[(3 + i % 9, i % 3) for i in range(40)]])
    mixed = json.loads(json.dumps(base))
    mixed["sources"]["sft"] = {"path": str(sft.path), "packing": "best_fit"}
    mixed["stages"][1]["mix"]["sft"] = 2
    weighted = json.loads(json.dumps(mixed))  # docs/mixtures.md, "Objective weights"
    weighted["stages"][0]["objective"] = {"code": 1, "docs": 3}
    weighted["stages"][1]["objective"] = {"code": 1, "docs": 1, "sft": 2}
    switched = json.loads(json.dumps(weighted))  # other objectives, switched to at SWITCH_AT
    switched["stages"][0]["objective"] = {"code": 4, "docs": 1}
    switched["stages"][1]["objective"] = {"code": 1, "sft": 5}
    return {
        "ramp": {**base, "global_batch_size": {"step": {0: 4, 5: 8, 12: 16}}},
        "prov": {**base, "grad_accum": 2, "feed": {"provenance": PROVENANCE}},
        "sft": mixed,
        "objective": {**weighted, "grad_accum": 2},
        "objective-device": {
            **base,
            "objective": {"docs": 1, "code": 2},
            "feed": {"expand": "device"},
        },
        "objective-switch": {**switched, "grad_accum": 2},
    }


def switched_ledger(raws: dict[str, dict]) -> dict:
    """The ledger of a run of "objective" switched at SWITCH_AT to "objective-switch" (its
    stages weigh their sources otherwise)."""
    from pipeline.plan.resume import reconcile

    before = Plan.from_config(parse_config(raws["objective"], origin="multihost.yaml"))
    after = parse_config(raws["objective-switch"], origin="multihost.yaml")
    return reconcile(before, after, SWITCH_AT, switch=True).to_json()


@pytest.fixture(scope="module")
def one_mesh(tmp_path_factory):
    """`run(name, processes, devices)`: the plan of test `name`'s config and the batches
    `processes` real processes built of its steps on a 4-device data mesh. One launch per
    process count serves every one-mesh test of that count (each its own task and config)."""
    root = tmp_path_factory.mktemp("one-mesh")
    raws = one_mesh_raws(root / "stores")
    ledger = switched_ledger(raws)
    launched: dict[tuple[int, int], Path] = {}

    def run(name: str, processes: int, devices: int) -> tuple[Plan, np.lib.npyio.NpzFile]:
        if (processes, devices) not in launched:
            out = root / f"{processes}x{devices}"
            out.mkdir()
            tasks = [
                {"kind": "checksums", "name": task, "config": raws[task], "mesh": [[4], ["data"]],
                 "batch_axes": ["data"], "steps": steps}
                for task, (steps, shapes) in ONE_MESH.items()
                if (processes, devices) in shapes
            ]  # fmt: skip
            for task in tasks:
                if task["name"] == "objective-switch":  # a feed of that ledger, not a config
                    task["ledger"] = ledger
            codes = launch(out, raws[name], tasks, processes, devices)
            assert codes == [0] * processes, worker_output(out)
            launched[processes, devices] = out
        plan = Plan.from_config(parse_config(raws[name], origin="multihost.yaml"))
        if name == "objective-switch":
            plan = Plan(Ledger.from_json(ledger), plan.stores())
        return plan, np.load(launched[processes, devices] / f"{name}.npz")

    return run


@pytest.mark.parametrize(("processes", "devices"), ONE_MESH["ramp"][1])
def test_a_batch_ramp_is_the_plan_at_any_step_on_1_2_and_4_processes(one_mesh, processes, devices):
    plan, result = one_mesh("ramp", processes, devices)
    for step in RAMP_STEPS:
        expected = plan.batch(step)
        assert expected["inputs"].shape[0] == (4 if step < 5 else 8 if step < 12 else 16)
        for field in FIELDS:
            np.testing.assert_array_equal(result[f"{field}_{step}"], expected[field])
        np.testing.assert_array_equal(result[f"checksum_{step}"], reference_checksums(expected))


@pytest.mark.parametrize(("processes", "devices"), ONE_MESH["prov"][1])
def test_provenance_fields_across_processes_equal_the_plans_draws(one_mesh, processes, devices):
    plan, result = one_mesh("prov", processes, devices)
    for step in STEPS:
        draws = plan.draws(step)  # row r is row r % 4 of micro-batch r // 4
        for name in PROVENANCE:
            np.testing.assert_array_equal(
                result[f"{name}_{step}"], getattr(draws, name).reshape(2, 4), err_msg=name
            )
        expected = plan.batch(step)
        for field in FIELDS:
            np.testing.assert_array_equal(result[f"{field}_{step}"].reshape(8, 8), expected[field])


@pytest.mark.parametrize(("processes", "devices"), ONE_MESH["objective"][1])
@pytest.mark.parametrize("name", ["objective", "objective-device", "objective-switch"])
def test_loss_weights_across_processes_equal_the_plans(one_mesh, name, processes, devices):
    """Derived on the devices from each process's rows (the host path with micro-batches and
    best_fit rows; the compact path; a ledger that switched the objective at SWITCH_AT), bit
    for bit the weights of the whole step."""
    plan, result = one_mesh(name, processes, devices)
    if name == "objective-switch":  # before the switch the old objective, after it the new
        unswitched = Plan(Ledger(plan.ledger.segments[:1]), plan.stores())
        for step in STEPS:
            same = np.array_equal(
                objective.step_weights(plan, step), objective.step_weights(unswitched, step)
            )
            assert same == (step < SWITCH_AT), step
    for step in STEPS:
        expected = objective.step_weights(plan, step)
        got = result[f"loss_weights_{step}"].reshape(expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=f"step {step}")


def expected_weights(plan: Plan, steps: int) -> list[float]:
    """The train task's model value after each of `steps` uninterrupted steps (float32, as
    jitted)."""
    w, weights = np.float32(0), []
    for step in range(steps):
        total = int(reference_checksums(plan.batch(step)).sum(dtype=np.int32))
        w = np.float32(w + np.float32(total % 9973))
        weights.append(float(w))
    return weights


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("batch", [8, {"step": {0: 4, 12: 8, 20: 16}}], ids=["fixed", "ramp"])
def test_crashes_and_host_count_changes_do_not_change_a_single_batch(tmp_path, batch):
    total, every = 30, 4
    raw = two_stage_raw(tmp_path / "stores", global_batch_size=batch)
    plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    stages = {int(s) for step in range(total) for s in plan.draws(step).stage}
    epochs = {int(e) for step in range(total) for e in plan.draws(step).epoch}
    assert stages == {0, 1} and max(epochs) >= 2  # the run crosses both kinds of event

    def train(name: str, processes: int, kill_at=None, kill_mode="step") -> list[int]:
        task = {"kind": "train", "ckpt": str(tmp_path / f"ckpt-{name}"), "steps": total,
                "log": str(tmp_path / f"{name}.jsonl"), "save_every": every,
                "kill_at": kill_at, "kill_mode": kill_mode}  # fmt: skip
        return launch(tmp_path, raw, [task], processes, 4 // processes)

    rng = random.Random(os.environ.get("PIPELINE_TEST_SEED", "0"))
    # what an uninterrupted run trains: the plan's batches, and the model value they add up to
    weights = expected_weights(plan, total)
    reference = {s: (reference_checksums(plan.batch(s)).tolist(), weights[s]) for s in range(total)}

    first = rng.randrange(5, 11)  # kill -9 between saves, before the stage change at 10
    second = rng.randrange(first // every + 1, 5) * every  # kill -9 while a save is in flight
    third = rng.randrange(second + 2, total - 2)  # on 2 hosts, after more rollovers
    runs = [(4, first, "step"), (4, second, "save"), (2, third, "step"), (1, None, "step")]
    for processes, kill_at, mode in runs:
        codes = train("elastic", processes, kill_at, mode)
        expected = [0] * processes if kill_at is None else [-signal.SIGKILL] * processes
        assert codes == expected, (processes, kill_at, worker_output(tmp_path))
    entries = read_log(tmp_path / "elastic.jsonl")
    assert {e["step"] for e in entries} == set(range(total))
    assert {e["procs"] for e in entries} == {4, 2, 1}
    for entry in entries:  # every step, including the replayed ones, equals the reference
        assert (entry["sums"], entry["w"]) == reference[entry["step"]], entry


def test_maxtext_iter_item_of_two_processes_restores_in_one(tmp_path):
    """2 -> 1 processes through real Orbax and Grain's per-process handler: every process's
    file holds the same state, and `restore_from` takes any of them (the --elastic path)."""
    from jax.sharding import Mesh

    from pipeline.maxtext.adapter import create_data_iterator, read_iter_state
    from tests.test_maxtext import maxtext_config, write_data_yaml

    data_yaml = write_data_yaml(tmp_path)
    raw = two_stage_raw(tmp_path)
    task = {"kind": "maxtext", "data_yaml": str(data_yaml), "ckpt": str(tmp_path / "ckpt"),
            "steps": 13}  # fmt: skip
    assert launch(tmp_path, raw, [task], 2, 2) == [0, 0], worker_output(tmp_path)
    item = tmp_path / "ckpt" / "12" / "iter"  # saved after training step 12
    files = sorted(p.name for p in item.glob("process_*"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    texts = {(item / name).read_text() for name in files}
    assert len(texts) == 1  # the same state in every process's file
    assert read_iter_state(item).step == 13

    import jax

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
    train, _ = create_data_iterator(maxtext_config(data_yaml, eval_interval=-1), mesh)
    try:
        train.restore_from(item)
        plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
        for step in (13, 14):
            batch = next(train)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), plan.batch(step)[field])
    finally:
        train.close()


@pytest.mark.parametrize(("processes", "devices"), ONE_MESH["sft"][1])
def test_best_fit_rows_are_the_plan_at_any_step_on_2_and_4_processes(one_mesh, processes, devices):
    """Whole-document rows of a masked store, mixed with windows, through the real feed."""
    plan, result = one_mesh("sft", processes, devices)
    for step in STEPS:
        expected = plan.batch(step)
        for field in FIELDS:
            np.testing.assert_array_equal(result[f"{field}_{step}"], expected[field])
    assert (plan.batch(23)["targets_segmentation"] == 0).any()  # the mask reached the batch
