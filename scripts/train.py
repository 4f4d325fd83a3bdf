"""Reference trainer: a MaxText-like loop on the pipeline's feed, with Orbax checkpoints.

    python scripts/train.py --data-config configs/default.yaml --checkpoint-dir runs/x \
        --steps 200 [--resume] [--switch-data] [--skip-data N [--skip-at S]] \
        [--num-processes 2 --devices-per-process 2]

One process, several processes on localhost (`--num-processes`: this script starts them, each
with simulated CPU devices), or one process per TPU VM worker (`tpu/run.sh`: JAX discovers the
slice by itself). Model and data state are saved together in one Orbax CheckpointManager step;
`--resume` restores both from the latest complete checkpoint, and `--switch-data` declares that
`--data-config` differs from the checkpoint's on purpose (a ledger switch). `--skip-data N`
(with `--resume`, alone or with `--switch-data`) passes over N steps of data after a loss
spike: the restored step s trains on what the plan had for step s + N (docs/steering.md).
`--skip-data N --skip-at S` skips at training step S instead, exactly once however often the
command is repeated: the form for a command that a restart loop re-runs (tpu/recover.sh).
A switch may change `seq_len` and `lanes` (context extension, docs/steering.md): start such a
run with `--positions` set to the longest `seq_len` it will reach, so the model's position
table keeps its shape across the switch.
`--adaptive-mix K` sets the mixture every K steps from the per-source losses
(`pipeline.feed.adaptive`, docs/mixtures.md "Adaptive mixtures"; `--adaptive-rate R`: its step
size); with `--resume` it continues from the weights the checkpoint's ledger holds.
`--adaptive-signal eval` makes it steer on held-out losses instead: at every K-th step, the
mean loss of each eval set named like a training source (the data config's `eval.sources`).

`--checkpoint-dir` and `--data-config` may be URLs (gs://bucket/run): Orbax writes there
natively and they are never turned into local paths. SIGTERM (a TPU preemption notice, or
tpu/stop.sh) makes every process save at the same step, then exit with status 75
(EX_TEMPFAIL: resume with --resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

log = logging.getLogger("pipeline")

PREEMPTED = 75  # exit status after a preemption checkpoint: EX_TEMPFAIL, "try again"


def _count(text: str) -> int:
    """An integer >= 0 (0: the option is off), refused by argparse naming the flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _rate(text: str) -> float:
    """A finite number > 0 (nan, inf and 0 would freeze or blow up the controller)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.skip_at is not None and not args.skip_data:
        parser.error("--skip-at S needs --skip-data N (the steps to pass over at step S)")
    return args


def build_parser() -> argparse.ArgumentParser:
    from pipeline.commands.help_format import RawDefaultsFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsFormatter)
    p.add_argument("--data-config", required=True, help="a path or a URL (gs://...)")
    p.add_argument("--checkpoint-dir", required=True, help="a path or a URL (gs://...)")
    p.add_argument("--steps", type=int, default=200, help="train until this step")
    p.add_argument("--save-every", type=int, default=20, help="save a checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="0: no eval")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint")
    p.add_argument("--switch-data", action="store_true", help="declare a data config switch")
    p.add_argument(
        "--positions",
        type=int,
        default=0,
        metavar="P",
        help="positions the model embeds (default: the data config's seq_len); for a run that "
        "will switch to a longer seq_len, the longest",
    )
    p.add_argument(
        "--skip-data",
        type=_count,
        default=0,
        metavar="N",
        help="with --resume: pass over N steps of data (the restored step s serves plan step s+N)",
    )
    p.add_argument(
        "--skip-at",
        type=_count,
        default=None,
        metavar="S",
        help="with --skip-data N: skip at training step S instead of the restored step, once "
        "in the run however often the command is repeated (a restart loop's form)",
    )
    p.add_argument(
        "--adaptive-mix",
        type=_count,
        default=0,
        metavar="K",
        help="every K steps, set the mixture from per-source losses (pipeline.feed.adaptive)",
    )
    p.add_argument(
        "--adaptive-rate",
        type=_rate,
        default=1.0,
        metavar="R",
        help="with --adaptive-mix: the controller's step size on the excess losses",
    )
    p.add_argument(
        "--adaptive-signal",
        choices=("train", "eval"),
        default="train",
        help="with --adaptive-mix: steer on each source's training loss (every step) or on "
        "its held-out loss (the eval set of the same name, every K steps)",
    )
    p.add_argument("--learning-rate", type=float, default=3e-3, help="the optimizer's step size")
    p.add_argument("--width", type=int, default=128, help="the toy model's embedding width")
    p.add_argument("--depth", type=int, default=2, help="the toy model's transformer layers")
    p.add_argument("--metrics", type=Path, help="append one JSON line per step (process 0)")
    p.add_argument("--num-processes", type=int, default=1, help="local processes to start")
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices")
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    return p


def location(value: str) -> str:
    """A URL as given (Orbax and etils.epath read gs:// natively); a local path made absolute."""
    from pipeline.urls import is_url

    return value if is_url(value) else str(Path(value).resolve())


class PreemptionNotice:
    """Whether to save and stop after a step, decided at the same step on every process.

    Under `jax.distributed`, JAX's preemption service owns SIGTERM (the notice a TPU VM gets
    before it is reclaimed) and agrees on a step with every process; Orbax exposes it as
    `CheckpointManager.reached_preemption`, which must be asked at every step. A process
    without `jax.distributed` records SIGTERM itself.
    """

    def __init__(self, manager, distributed: bool) -> None:
        self.manager = manager
        self.signalled = False
        if not distributed:
            signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.signalled = True

    def reached(self, step: int) -> bool:
        return self.signalled or self.manager.reached_preemption(step)


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Start `--num-processes` copies of this script on localhost and wait for all of them.

    SIGTERM and SIGINT are passed on to every child, so a preemption notice reaches them all.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *argv,
                "--process-id",
                str(i),
                "--coordinator",
                f"127.0.0.1:{port}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.num_processes)
    ]
    relays = [threading.Thread(target=relay_stdout, args=(child.stdout,)) for child in children]
    for relay in relays:
        relay.start()

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        codes = [child.wait() for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        for relay in relays:
            relay.join()  # each ends at its child's end of output
    return next((code for code in codes if code), 0)


GLOO = ("[Gloo] ", "connected peer ranks")
"""What marks Gloo's lines, or the tail of one that another thread's line cut in two."""


def relay_stdout(stream: TextIO) -> None:
    """Pass a child's stdout on, except Gloo's lines: JAX's CPU collectives print one per
    process and communicator ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of
    connected peer ranks is : 1"), 8 per launch of 2 processes, with no switch to turn them off,
    from several threads at once, so one may be split around another, or two written as one
    line and their two newlines left as an empty line (the trainer writes no empty line), or
    its last number cut off onto a line of its own (the trainer writes no bare number)."""
    for line in stream:
        if not line.strip().isdigit() and line.strip() and not any(m in line for m in GLOO):
            sys.stdout.write(line)
            sys.stdout.flush()


def refuse_a_used_checkpoint_dir(args: argparse.Namespace) -> None:
    """Without --resume a run starts at step 0: in a directory that holds another run's
    checkpoints it would save its steps among the old ones and mix the two runs. Orbax names
    each complete step's directory by its number (renamed into place last)."""
    from pipeline.errors import ConfigError
    from pipeline.urls import location as url_or_path

    directory = url_or_path(location(args.checkpoint_dir))
    if args.resume or not directory.is_dir():
        return
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    if steps:
        raise ConfigError(
            f"{directory}: holds a run's checkpoints (latest step {steps[-1]}); pass --resume "
            "to continue it, or give another --checkpoint-dir"
        )


def check_positions(checkpoint_dir: str, step: int, positions: int, given: int) -> None:
    """The checkpoint's position table must have the model's shape: a switch to a longer
    seq_len restores a model whose table was sized by --positions when the run started."""
    import orbax.checkpoint as ocp
    from etils import epath

    from pipeline.errors import ConfigError

    item = epath.Path(checkpoint_dir) / str(step) / "state"
    meta = ocp.StandardCheckpointHandler().metadata(item)  # shapes only, no array read
    saved = getattr(meta, "tree", meta)["params"]["position"].shape[0]
    if saved == positions:
        return
    source = f"--positions {given}" if given else "the data config's seq_len, no --positions"
    fix = (
        f"give --positions {saved}"
        if saved > positions
        else "a run that switches to a longer seq_len starts with --positions set to the "
        f"longest it will reach (docs/steering.md): continue at seq_len {saved} or below, or "
        "start a new run"
    )
    raise ConfigError(
        f"{checkpoint_dir} step {step}: the checkpoint's position table holds {saved} "
        f"positions, this run's model {positions} ({source}); {fix}"
    )


def initialize(args: argparse.Namespace) -> bool:
    """Start jax.distributed where there is more than this process; True if it was started."""
    import jax

    if args.process_id is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        return True
    if os.environ.get("JAX_PLATFORMS", "").startswith("tpu"):
        jax.distributed.initialize()  # a TPU VM slice describes itself
        return True
    return False


def train(args: argparse.Namespace, distributed: bool = False) -> int:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from pipeline.extras import require
    from pipeline.feed.checkpoint import DataRestore, DataSave
    from pipeline.feed.data_feed import DataFeed
    from pipeline.feed.eval_feed import eval_feeds
    from pipeline.feed.restore import current_state, restore_state

    require("optax", "train", "scripts/train.py")  # tiny_lm's optimizer
    from heartbeat import Heartbeat
    from tiny_lm import ModelConfig, init_params, loss_and_weights, make_train_step, optimizer

    primary = jax.process_index() == 0
    config = load_config(args.data_config)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    feed = DataFeed(config, mesh, ("data",), provenance=("source",))  # per-source loss
    vocab = feed.plan.vocab_size
    positions = args.positions or config.seq_len
    if positions < config.seq_len:
        raise ConfigError(
            f"--positions {positions} is below the data config's seq_len "
            f"{config.seq_len}; give at least {config.seq_len}"
        )
    model = ModelConfig(vocab, positions, args.width, args.depth)
    tx = optimizer(args.learning_rate)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.device_put(init_params(model, jax.random.key(config.seed)), replicated)
    state = {"params": params, "opt_state": jax.device_put(tx.init(params), replicated)}
    options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
    checkpoint_dir = location(args.checkpoint_dir)
    manager = ocp.CheckpointManager(checkpoint_dir, options=options)
    notice = PreemptionNotice(manager, distributed)
    if args.resume and manager.latest_step() is not None:
        # before the restore: a switch is logged only by a restore that can succeed
        check_positions(checkpoint_dir, manager.latest_step(), positions, args.positions)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(
            manager.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=DataRestore(
                    feed,
                    switch=args.switch_data,
                    switch_flag="--switch-data",
                    skip_steps=args.skip_data,
                    skip_at=args.skip_at,
                ),
            ),
        )
        state = restored.state
        log.info("resumed at step %d from %s", feed.step, checkpoint_dir)
    elif args.skip_at is not None and not args.switch_data:  # no checkpoint yet: schedule it
        restore_state(feed, current_state(feed), skip_steps=args.skip_data, skip_at=args.skip_at)
    elif args.switch_data or args.skip_data:
        flag = "--switch-data" if args.switch_data else "--skip-data"
        raise ConfigError(f"{flag}: no checkpoint in {checkpoint_dir} to restore from")
    elif args.resume:  # say so: a wrong --checkpoint-dir would silently train from scratch
        log.info("--resume: no checkpoint in %s; starting at step 0", checkpoint_dir)
    step_fn = make_train_step(model, tx, num_sources=len(feed.source_names()))
    eval_fn = jax.jit(lambda p, b: loss_and_weights(p, b, model)[0])
    held_out_signal = bool(args.adaptive_mix) and args.adaptive_signal == "eval"
    evals = eval_feeds(config, mesh) if args.eval_every or held_out_signal else []
    params, opt_state = state["params"], state["opt_state"]
    controller, held = None, []
    if args.adaptive_mix:
        from pipeline.feed.adaptive import HELD_OUT, ExcessLoss, held_out
        from pipeline.plan.report import target_shares

        shares = target_shares(feed.plan, np.array([feed.step]))
        initial = {name: float(share[0]) for name, share in shares.items()}
        settings = HELD_OUT if held_out_signal else {}
        held = held_out(feed.source_names(), evals) if held_out_signal else []
        controller = ExcessLoss(
            feed.source_names(),
            every=args.adaptive_mix,
            rate=args.adaptive_rate,
            initial=initial,
            **settings,
        )
    metrics_file = open(args.metrics, "a") if primary and args.metrics else None  # noqa: SIM115
    heartbeat = Heartbeat.from_env(args.save_every)
    preempted = False
    try:
        while feed.step < args.steps:
            step = feed.step
            started = time.perf_counter()
            batch = next(feed)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            loss = float(metrics["loss"])
            seconds = time.perf_counter() - started
            evaluated = {}
            if args.eval_every and (step + 1) % args.eval_every == 0:  # every process runs it
                for ev in evals:
                    evaluated[f"eval_{ev.name}"] = mean_loss(eval_fn, params, ev)
            names = feed.source_names(step)
            losses = dict(zip(names, np.asarray(metrics["source_loss"]).tolist()))
            mix, held_losses = None, {}
            if controller is not None and held:  # every process, at steering steps only
                if controller.due(feed.step):
                    held_losses = {ev.name: mean_loss(eval_fn, params, ev) for ev in held}
                    controller.observe(held_losses)
                mix = controller.steer(feed)
            elif controller is not None:  # every process: the losses are the global batch's
                controller.observe(losses)
                mix = controller.steer(feed)
            if primary:  # only the logging process re-derives the step's stage and epochs
                record = {**step_record(feed, step, loss, metrics, seconds), **evaluated}
                record["source_loss"] = {n: v for n, v in losses.items() if v == v}  # not NaN
                if held_losses:
                    record["held_out_loss"] = held_losses
                if mix is not None:
                    record["mix"] = mix
                    log.info("step %d: adaptive mix from step %d: %s", step, feed.step, mix)
                record["input_wait_s"] = feed.stats().last_wait_s
                log.info(format_record(record))
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
            done = step + 1
            heartbeat.beat(done, jax.process_index(), feed)
            preempted = notice.reached(done)  # every process asks at every step
            if preempted or done % args.save_every == 0 or done == args.steps:
                manager.save(
                    done,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                        data=DataSave(feed),
                    ),
                    force=preempted,
                )
            if preempted:
                break
        manager.wait_until_finished()
        if preempted and done < args.steps:  # a notice at the last step: the run is complete
            log.info("preempted: saved step %d to %s; resume with --resume", done, checkpoint_dir)
            return PREEMPTED
    finally:
        if metrics_file:
            metrics_file.close()
        feed.close()
        for ev in evals:
            ev.close()
        manager.close()
    return 0


def mean_loss(eval_fn, params, feed) -> float:
    """The mean of `eval_fn`'s loss over an eval feed's batches (the same on every process:
    each is a global batch's)."""
    losses = [float(eval_fn(params, batch)) for batch in feed]
    return sum(losses) / len(losses)


def step_record(feed, step: int, loss: float, metrics: dict, seconds: float) -> dict:
    """The per-step log record: stage, epochs per source, loss, total_weights, the share of
    target tokens trained on (below 1 for masked prompts and whole-document padding), tokens/s."""
    draws = feed.plan.draws(step)
    summary = draws.summary()
    config = feed.plan.segment_plan(draws.segment_index).config
    return {
        "step": step,
        "stage": summary.stage_label,
        "loss": loss,
        "total_weights": int(metrics["total_weights"]),
        "trained_fraction": int(metrics["total_weights"]) / (len(draws.rows) * config.seq_len),
        "tokens_per_s": len(draws.rows) * config.seq_len / seconds,
        "epochs": dict(summary.epochs),
        "checksum": int(metrics["checksum"]),
    }


def format_record(record: dict) -> str:
    epochs = " ".join(f"{name}={epoch}" for name, epoch in sorted(record["epochs"].items()))
    evals = "".join(f" | {k} {v:.4f}" for k, v in record.items() if k.startswith("eval_"))
    losses = " ".join(f"{n}={v:.3f}" for n, v in sorted(record["source_loss"].items()))
    return (
        f"step {record['step']} | stage {record['stage']} | loss {record['loss']:.4f} "
        f"({losses}) | total_weights {record['total_weights']} | trained "
        f"{record['trained_fraction']:.1%} | tokens/s {record['tokens_per_s']:,.0f} | wait "
        f"{record['input_wait_s'] * 1e3:.1f} ms | "
        f"epochs {epochs}{evals}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"[p{args.process_id or 0}] %(message)s" if args.process_id else "%(message)s",
        stream=sys.stderr,
    )
    for noisy in ("absl", "jax", "orbax", "gcsfs", "fsspec"):  # their INFO lines: each open
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from pipeline.errors import ConfigError, PipelineError
    from pipeline.urls import check_reachable

    try:
        if (args.switch_data or args.skip_data) and not args.resume:
            flag = "--switch-data" if args.switch_data else "--skip-data"
            raise ConfigError(f"{flag} needs --resume and a checkpoint to restore from")
        for url in (args.checkpoint_dir, args.data_config):  # seconds, not gcsfs's minutes
            check_reachable(url)
        if args.process_id is None:  # started by hand, not by launch_local: check once
            refuse_a_used_checkpoint_dir(args)
        if args.num_processes > 1 and args.process_id is None:
            return launch_local(args, argv)
        return train(args, distributed=initialize(args))
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
