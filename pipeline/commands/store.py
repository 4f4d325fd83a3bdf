"""Store commands: `prepare`, `verify-store`, `store-info`."""

from __future__ import annotations

import argparse

from pipeline.errors import PrepareError
from pipeline.store.prepare import PrepareOptions, prepare
from pipeline.store.summary import describe_store
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import DEFAULT_RECORD_TOKENS
from pipeline.urls import location


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "prepare",
        help="tokenize text into a token store",
        description="Tokenize INPUTs (directories, globs, text/JSONL/Parquet files, "
        "tfds:NAME[/CONFIG]:SPLIT, builtin:python-code|python-tests|python-docs) into a store.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument(
        "--out", required=True, type=location, help="store directory (or gs:// URL) to create"
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default), sentencepiece:MODEL or hf:TOKENIZER_JSON (local files)",
    )
    p.add_argument("--text-field", default="text", help="JSONL/Parquet/TFDS text field")
    p.add_argument("--num-shards", type=int, default=8)
    p.add_argument(
        "--record-tokens",
        type=int,
        default=DEFAULT_RECORD_TOKENS,
        help="split longer documents into records of at most this many tokens (default "
        f"{DEFAULT_RECORD_TOKENS}), so a window reads about what it needs",
    )
    p.add_argument(
        "--no-flat-tokens",
        action="store_true",
        help="do not write the flat token sidecar per shard (the feed then reads ArrayRecord "
        "records, slower; the sidecar doubles the disk space)",
    )
    p.add_argument("--seed", type=int, default=0, help="document order shuffle seed")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="held-out document share")
    p.add_argument("--eval-out", type=location, help="eval store directory (default OUT-eval)")
    p.add_argument("--tfds-data-dir", help="TFDS data dir (default $TFDS_DATA_DIR)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--verify", action="store_true", help="re-open and checksum the result")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--runner",
        choices=["local", "beam"],
        default="local",
        help="local (default) or beam: an Apache Beam pipeline; Beam's own options "
        "(--runner=DataflowRunner ...) follow a lone --",
    )
    p.set_defaults(run=run_prepare, takes_passthrough=True)

    v = commands.add_parser("verify-store", help="check a store's files and checksums")
    v.add_argument("store", type=location)
    v.set_defaults(run=run_verify_store)

    i = commands.add_parser("store-info", help="summarise a store and decode a window")
    i.add_argument("store", type=location)
    i.set_defaults(run=run_store_info)


def run_prepare(args: argparse.Namespace) -> int:
    options = PrepareOptions(
        inputs=args.inputs,
        out=args.out,
        tokenizer=args.tokenizer,
        num_shards=args.num_shards,
        record_tokens=args.record_tokens,
        flat_tokens=not args.no_flat_tokens,
        seed=args.seed,
        workers=args.workers,
        eval_fraction=args.eval_fraction,
        eval_out=args.eval_out,
        text_field=args.text_field,
        tfds_data_dir=args.tfds_data_dir,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    if args.runner == "beam":
        from pipeline.store.prepare_beam import prepare_beam  # Beam is an optional extra

        paths = prepare_beam(options, args.passthrough)
    elif args.passthrough:
        raise PrepareError(
            f"options after -- ({' '.join(args.passthrough)}) are Beam's; add --runner beam"
        )
    else:
        paths = prepare(options)
    for split, path in paths.items():
        store = TokenStore(path, verify=args.verify)
        print(f"{split}: {describe_store(store)}")
    return 0


def run_verify_store(args: argparse.Namespace) -> int:
    store = TokenStore(args.store, verify=True)
    print(f"ok: {describe_store(store)}")
    return 0


def run_store_info(args: argparse.Namespace) -> int:
    store = TokenStore(args.store)
    print(describe_store(store))
    return 0
