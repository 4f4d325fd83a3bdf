"""Store commands: `prepare`, `verify-store`, `store-info`."""

from __future__ import annotations

import argparse
import logging
import os

from pipeline.commands.summary import describe_store
from pipeline.errors import PrepareError, StoreError
from pipeline.extras import require_installed
from pipeline.in_place import DEFAULT_COLUMN, IN_PLACE_FORMATS
from pipeline.ingest.builtin import INSTRUCTION_CORPORA
from pipeline.ingest.chat import ROW_FORMATS, TRAIN_ON, RowFields
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.store.formats import IN_PLACE, open_store
from pipeline.store.inplace import InPlaceStore
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import DEFAULT_RECORD_TOKENS
from pipeline.urls import is_url, location


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "prepare",
        help="tokenize text into a token store",
        description="Tokenize INPUTs (directories, globs, text/JSONL/Parquet files, the same "
        "in a bucket (gs://BUCKET/object, prefix or glob), "
        "tfds:NAME[/CONFIG]:SPLIT, builtin:python-code|python-tests|python-docs, "
        "builtin:python-docstrings|python-docstrings-chat) into a store. Instruction and chat "
        "rows (--format) get a loss mask: see docs/instruction-data.md.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="what to tokenize (see above)")
    p.add_argument(
        "--out", required=True, type=location, help="store directory (or gs:// URL) to create"
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default), sentencepiece:MODEL or hf:TOKENIZER_JSON (local files)",
    )
    # default None, like the row options below: a given --text-field a row format ignores is refused
    p.add_argument(
        "--text-field", help="JSONL/Parquet/TFDS text field, with --format text (default text)"
    )
    rows = p.add_argument_group("instruction and chat rows (JSONL / Parquet)")
    rows.add_argument(
        "--format",
        choices=ROW_FORMATS,
        default="text",
        help="text (default: pre-training text), messages (chat, rendered by a chat template) "
        "or prompt-completion rows",
    )
    # defaults are None so that an option given with a format that does not read it is refused
    rows.add_argument("--messages-field", help="field of the messages list (default messages)")
    rows.add_argument("--prompt-field", help="field of the prompt (default prompt)")
    rows.add_argument("--completion-field", help="field of the completion (default completion)")
    rows.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        help="tokens that carry loss: assistant messages (default; for prompt-completion the "
        "completion), completion (the last assistant message), or all",
    )
    rows.add_argument(
        "--chat-template",
        help="auto (default: the tokenizer_config.json beside an hf: tokenizer, else builtin), "
        "builtin, or a tokenizer_config.json / Jinja file",
    )
    rows.add_argument(
        "--skip-bad-rows",
        action="store_true",
        default=None,
        help="leave out rows that cannot be trained on, counted in the manifest (default: stop)",
    )
    ids = p.add_argument_group("document ids (docs/token-store.md; sources.NAME.exclude)")
    ids.add_argument(
        "--id-field",
        help="record each document's id: this JSONL field / Parquet column (a string or an "
        "integer); other inputs' documents get their key (relative path, :line, :row N)",
    )
    ids.add_argument(
        "--record-ids",
        action="store_true",
        help="record each document's key (relative path, :line, :row N) as its id",
    )
    p.add_argument("--num-shards", type=int, default=8, help="shard files per store (default 8)")
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out directory, deleting whatever it holds (store or not)",
    )
    p.add_argument("--verify", action="store_true", help="re-open and checksum the result")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--runner",
        choices=["local", "beam"],
        default="local",
        help="local (default) or beam: an Apache Beam pipeline; Beam's own options "
        "(--runner=DataflowRunner ...) follow a lone --",
    )
    p.set_defaults(run=run_prepare, takes_passthrough=True)

    v = commands.add_parser(
        "verify-store",
        help="check a store's files and checksums",
        description="Read every byte of a token store (or of the corpus an in-place index "
        "reads) against the checksums and sizes its manifest records; print one line naming "
        "what was checked, or stop with one line naming the first file that differs (exit 2).",
    )
    v.add_argument("store", type=location, metavar="STORE", help="store directory or gs:// URL")
    v.set_defaults(run=run_verify_store)

    i = commands.add_parser(
        "store-info",
        help="summarise a store: documents, tokens, shards, tokenizer",
        description="Print one line about a token store (or an in-place index) from its "
        "manifest: documents, tokens, shards, tokenizer, id type, loss mask. Reads no shard.",
    )
    i.add_argument("store", type=location, metavar="STORE", help="store directory or gs:// URL")
    i.set_defaults(run=run_store_info)

    x = commands.add_parser(
        "index",
        help="index a tokenized corpus (Megatron .bin/.idx, Parquet/Arrow) to read it in place",
        description="Index a tokenized corpus, read and never rewritten, for `format: megatron` "
        "or `format: parquet` sources: documents, checksums and identity "
        "(docs/in-place-corpora.md).",
    )
    x.add_argument(
        "data",
        metavar="DATA",
        help="megatron: PREFIX (of PREFIX.bin/.idx); parquet: a directory, a file or a glob",
    )
    x.add_argument(
        "--format",
        choices=IN_PLACE_FORMATS,
        default="megatron",
        help="megatron: PREFIX.bin + PREFIX.idx; parquet: Parquet or Arrow files of token "
        "lists (default megatron)",
    )
    x.add_argument("--column", help=f"parquet: the token column (default {DEFAULT_COLUMN})")
    x.add_argument(
        "--labels",
        metavar="COLUMN",
        help="parquet: a labels column, the corpus's loss mask (each label the id at its "
        "position, or -100: no loss)",
    )
    x.add_argument(
        "--loss-mask",
        metavar="COLUMN",
        help="parquet: a 0/1 (or boolean) column, the corpus's loss mask (0: no loss); "
        "instead of --labels",
    )
    x.add_argument("--out", help="index directory (default DATA.pipeline-index)")
    x.add_argument("--vocab-size", type=int, help="ids are below this (default: largest id + 1)")
    x.set_defaults(run=run_index)


# each row option and the --format values that read it
ROW_OPTIONS = {
    "text_field": ("text",),
    "messages_field": ("messages",),
    "prompt_field": ("prompt-completion",),
    "completion_field": ("prompt-completion",),
    "train_on": ("messages", "prompt-completion"),
    "chat_template": ("messages",),
    "skip_bad_rows": ("messages", "prompt-completion"),
}
# the options naming a row field, and the field each names
FIELD_OPTIONS = {
    "text_field": "text",
    "messages_field": "messages",
    "prompt_field": "prompt",
    "completion_field": "completion",
}


def _flag(name: str) -> str:
    """The command-line spelling of an option's attribute name."""
    return f"--{name.replace('_', '-')}"


def row_options(args: argparse.Namespace) -> dict[str, object]:
    """The row options given; one no input's format reads is refused, not ignored.

    A builtin instruction corpus brings its own format (and fields): its rows read --train-on,
    --skip-bad-rows and (chat) --chat-template whatever --format says; the --*-field options
    are read only with --format, and only by inputs that have fields (`check_fields_read`,
    once the inputs are resolved).
    """
    builtin = {
        INSTRUCTION_CORPORA[name].format
        for name in (arg.removeprefix("builtin:") for arg in args.inputs)
        if name in INSTRUCTION_CORPORA
    }
    given = {name: getattr(args, name) for name in ROW_OPTIONS if getattr(args, name) is not None}
    for name in given:
        formats = {args.format} if name in FIELD_OPTIONS else {args.format, *builtin}
        if not formats & set(ROW_OPTIONS[name]):
            raise PrepareError(
                f"{_flag(name)} is not read with --format {args.format}; it is for "
                f"--format {' or '.join(ROW_OPTIONS[name])} (docs/instruction-data.md)"
            )
    return given


def run_prepare(args: argparse.Namespace) -> int:
    given = row_options(args)
    fields = {FIELD_OPTIONS[name]: value for name, value in given.items() if name in FIELD_OPTIONS}
    row_fields = RowFields(args.format, **fields)
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
        text_field=row_fields.text,
        tfds_data_dir=args.tfds_data_dir,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        fields=row_fields,
        id_field=args.id_field,
        record_ids=args.record_ids,
        field_options=tuple(_flag(name) for name in given if name in FIELD_OPTIONS),
        **{name: value for name, value in given.items() if name not in FIELD_OPTIONS},
    )
    if args.runner == "beam":
        if _names_dask(args.passthrough):  # its extra brings Beam too: name that one first
            require_installed("apache_beam", "dask", "Beam's DaskRunner")
        from pipeline.ingest.prepare_beam import prepare_beam  # Beam is an optional extra

        # Beam's and Dask's INFO logs are their machinery's (servers started, caches made,
        # workers joining): their warnings stay. Dask sets its loggers' levels from its config
        # when imported, in this process and in the workers a local cluster starts (which
        # inherit the environment); a user's own setting wins.
        logging.getLogger("apache_beam").setLevel(logging.WARNING)
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
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


def _names_dask(beam_args: list[str]) -> bool:
    """Whether Beam's flags choose its Dask runner (`--runner=dask`, `--runner DaskRunner`)."""
    runners = [
        value
        for flag, value in zip(["", *beam_args], beam_args)
        if flag == "--runner" or value.startswith("--runner=")
    ]
    return bool(runners) and "dask" in runners[-1].lower()


def run_verify_store(args: argparse.Namespace) -> int:
    store = open_store(args.store, verify=True)
    checked = ""
    if isinstance(store, InPlaceStore):  # an index: say which corpus files were read
        checked = f"; checked {', '.join(str(f) for f in store.data_files())}"
    print(f"ok: {describe_store(store)}{checked}")
    return 0


def run_store_info(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    print(describe_store(store))
    return 0


def run_index(args: argparse.Namespace) -> int:
    for flag, value in (("DATA", args.data), ("--out", args.out)):
        if value is not None and is_url(value):  # Path() would make "gs:/b/..." of it
            raise StoreError(
                f"{value}: a corpus read in place is indexed and read from a local path, not a "
                f"bucket ({flag}); mount the bucket (e.g. gcsfuse) or copy the corpus, or "
                "tokenize it into a store with pipeline prepare (docs/in-place-corpora.md)"
            )
    path = IN_PLACE[args.format].build_index(
        args.data,
        args.out,
        column=args.column,
        labels=args.labels,
        loss_mask=args.loss_mask,
        vocab_size=args.vocab_size,
    )
    store = open_store(path)
    eod = store.eod_id if store.eod_id >= 0 else "none (documents carry no end token)"
    print(f"{describe_store(store)}; eod id: {eod}")
    return 0
