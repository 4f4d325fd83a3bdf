"""`make demo`: prepare the builtin corpora into data/ and show what the pipeline makes of them."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.prepare import PrepareOptions, prepare
from pipeline.store import TokenStore, is_store
from pipeline.store_summary import decode_preview, describe_store

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
BUILTIN = {"python-code": 8, "python-tests": 8, "python-docs": 2}


def prepare_builtin_stores() -> dict[str, Path]:
    stores = {}
    for name, shards in BUILTIN.items():
        out = DATA / name
        if not is_store(out):
            print(f"preparing builtin:{name} -> {out}", flush=True)
            options = PrepareOptions(
                inputs=[f"builtin:{name}"],
                out=out,
                num_shards=shards,
                workers=2,
                eval_fraction=0.02,
                overwrite=True,
            )
            prepare(options)
        stores[name] = out
    return stores


def main() -> int:
    for name, path in prepare_builtin_stores().items():
        store = TokenStore(path)
        print(describe_store(store))
        span = store.read_tokens(1000, 1000 + 120)
        print(f"  window [1000, 1120) of {name}: {decode_preview(store, span.tokens)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
