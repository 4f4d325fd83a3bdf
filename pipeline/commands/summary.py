"""Human-readable summaries and decoded previews of stores (for the CLI, demo and inspect)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from pipeline.errors import TokenizerError
from pipeline.ingest.tokenizers import Tokenizer, load_tokenizer
from pipeline.store.token_store import TokenStore
from pipeline.wording import counted


def describe_store(store: TokenStore) -> str:
    """One line; it names rows that `prepare --skip-bad-rows` left out, whatever printed it."""
    skipped = (store.manifest.get("created") or {}).get("bad_rows_skipped") or 0
    return (
        f"{store.path}: {counted(store.num_documents, 'document')}, "
        f"{counted(store.num_tokens, 'token')}, {counted(store.num_shards, 'shard')}, "
        f"tokenizer {store.manifest['tokenizer']['name']}, "
        f"{store.dtype.name}"
        + (", with a loss mask" if store.masked else "")
        + (f", {counted(skipped, 'bad row')} left out (--skip-bad-rows)" if skipped else "")
    )


@lru_cache(maxsize=8)
def _tokenizer(spec: str) -> Tokenizer | None:
    try:
        return load_tokenizer(spec)
    except TokenizerError:
        return None  # the tokenizer file is not on this machine: show ids instead


def decode_preview(store: TokenStore, tokens: np.ndarray, limit: int = 200) -> str:
    """Decoded text of `tokens` (ids if the store's tokenizer file is not available here)."""
    tokenizer = _tokenizer(store.manifest["tokenizer"]["spec"])
    if tokenizer is None:
        return " ".join(str(int(t)) for t in tokens[:limit])
    text = tokenizer.decode([int(t) for t in tokens])
    return text if len(text) <= limit else text[:limit] + "…"
