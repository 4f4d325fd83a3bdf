"""One vocabulary per config: stores whose ids mean different things are refused."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.config import DataConfig
from pipeline.errors import ConfigError
from pipeline.store.meta import StoreMeta


def check_one_vocabulary(config: DataConfig, stores: Mapping[str, StoreMeta]) -> None:
    """Refuse stores (by config key) whose ids mean different things, unless the config says so.

    Ids of two tokenizers index different vocabularies, and a trainer would size the model by
    the larger one; `shared_vocabulary: true` declares that they agree on purpose (e.g. one
    model file saved twice with different bytes). Reads the stores' manifests only.
    """
    if config.shared_vocabulary:
        return
    first_name, first = next(iter(stores.items()))
    want = first.tokenizer_identity
    for name, meta in stores.items():
        # one entry of a host's summary stands for the stores of one tokenizer (`meta_cache`)
        if meta.tokenizer is not first.tokenizer and meta.tokenizer_identity != want:
            raise ConfigError(
                f"{config.origin}: {first_name} and {name} were prepared with "
                f"different tokenizers ({_tokenizer(first)} vs {_tokenizer(meta)}); prepare "
                "them with one tokenizer, or set shared_vocabulary: true if their ids agree "
                "on purpose"
            )


def _tokenizer(meta: StoreMeta) -> str:
    return f"{meta.tokenizer['name']}, vocab {meta.tokenizer['vocab_size']}"
