"""Tokenizers that turn document text into token ids for `prepare`.

A tokenizer is named by a short spec string, the one the user types:

* ``bytes``: UTF-8 bytes, ids 0..255, end-of-document id 256. No file, no vocabulary drift.
* ``sentencepiece:PATH``: a SentencePiece ``.model`` file.
* ``hf:PATH``: a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``).

Every tokenizer reserves one **end-of-document** id (``eod_id``) that `prepare` appends after each
document; ``encode`` never appends it. ``name`` is the identity recorded in a store manifest: for
file-based tokenizers it carries the first 16 hex digits of the file's SHA-256, so a store says
exactly which vocabulary produced it and a changed file is detected, not silently mixed in.

Tokenizers are sent to multiprocessing workers, so they pickle as their spec and the name they
loaded; unpickling reloads the file and refuses a file whose content has changed since.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.errors import TokenizerError
from pipeline.extras import require

__all__ = [
    "EOD_TEXT",
    "TOKENIZER_KINDS",
    "BytesTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

EOD_TEXT = "<|eod|>"
"""How `Tokenizer.decode` renders the end-of-document id."""

TOKENIZER_KINDS = ("bytes", "sentencepiece:MODEL", "hf:TOKENIZER_JSON")
"""The spec forms `load_tokenizer` accepts, for error messages and `--help`."""

HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
"""Tokens a `tokenizers` vocabulary uses as end-of-document, in order of preference."""


class Tokenizer(abc.ABC):
    """Text -> int64 ids, with one reserved end-of-document id.

    Attributes:
      spec: what the user typed (``bytes``, ``sentencepiece:PATH``, ``hf:PATH``).
      name: identity recorded in a store manifest (kind, file basename, content hash).
      kind: ``bytes``, ``sentencepiece`` or ``hf``.
      model_sha256: SHA-256 of the model file (empty for ``bytes``, which has none).
      vocab_size: number of ids, including ``eod_id``; every id is in ``[0, vocab_size)``.
      eod_id: the end-of-document id that `prepare` appends after each document.
    """

    spec: str
    name: str
    kind: str
    model_sha256: str
    vocab_size: int
    eod_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Returns the ids of ``text`` as int64, without the end-of-document id."""

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text; a tokenizer that encodes a batch faster than one text at a
        time (in native threads, without Python between texts) overrides it."""
        return [self.encode(text) for text in texts]

    @abc.abstractmethod
    def _decode_piece(self, ids: list[int]) -> str:
        """Decodes ids that contain no ``eod_id``."""

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Renders ids as text, each end-of-document id as ``<|eod|>``, to inspect a store."""
        values = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        for value in values:
            if not 0 <= value < self.vocab_size:
                raise TokenizerError(
                    f"tokenizer {self.name}: id {value} is outside [0, {self.vocab_size}); "
                    "decode ids produced by this tokenizer"
                )
        pieces: list[str] = []
        start = 0
        for i, value in enumerate(values):
            if value == self.eod_id:
                pieces.append(self._decode_piece(values[start:i]))
                pieces.append(EOD_TEXT)
                start = i + 1
        pieces.append(self._decode_piece(values[start:]))
        return "".join(pieces)

    def __getstate__(self) -> dict[str, Any]:
        # Only the spec and identity travel to workers; the model is reloaded there.
        return {"spec": self.spec, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = load_tokenizer(state["spec"])
        if fresh.name != state["name"]:
            raise TokenizerError(
                f"tokenizer {state['spec']!r}: the file changed after it was loaded "
                f"({state['name']} -> {fresh.name}); keep the tokenizer file fixed during prepare"
            )
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"eod_id={self.eod_id})"
        )


class BytesTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and eod 256: needs no file, so it suits tests and demos."""

    def __init__(self) -> None:
        self.spec = "bytes"
        self.name = "bytes"
        self.kind = "bytes"
        self.model_sha256 = ""
        self.vocab_size = 257
        self.eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise TokenizerError(
                f"tokenizer bytes: text is not encodable as UTF-8 ({error.reason} at "
                f"character {error.start}); remove lone surrogates from the input"
            ) from None
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def _decode_piece(self, ids: list[int]) -> str:
        # A window may cut a multi-byte character; show the damage instead of failing.
        return bytes(ids).decode("utf-8", errors="replace")


def _read_model_file(spec: str, path: str, what: str) -> bytes:
    """Reads a tokenizer file whole (it is hashed and parsed from the same bytes)."""
    if not path:
        raise TokenizerError(f"tokenizer {spec!r}: no file given; write {what}")
    if os.path.isdir(path):
        raise TokenizerError(
            f"tokenizer {spec!r}: {path} is a directory; give the path of the file itself"
        )
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise TokenizerError(
            f"tokenizer {spec!r}: file {path} does not exist; check the path"
        ) from None
    except OSError as error:
        raise TokenizerError(
            f"tokenizer {spec!r}: cannot read {path} ({error.strerror}); check its permissions"
        ) from None


def _file_name(kind: str, path: str, data: bytes) -> str:
    return f"{kind}:{os.path.basename(path)}@{hashlib.sha256(data).hexdigest()[:16]}"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is the model's ``</s>`` when it has one, else a new last id."""

    def __init__(self, spec: str, path: str) -> None:
        sentencepiece = require("sentencepiece", "tokenizers", f"tokenizer {spec!r}")
        data = _read_model_file(spec, path, "sentencepiece:PATH/TO/MODEL.model")
        try:
            model = sentencepiece.SentencePieceProcessor(model_proto=data)
        except Exception as error:  # sentencepiece raises RuntimeError/OSError variants.
            raise TokenizerError(
                f"tokenizer {spec!r}: {path} is not a SentencePiece model "
                f"({_first_line(error)}); "
                "give a .model file written by SentencePieceTrainer"
            ) from None
        self.spec = spec
        self.name = _file_name("sentencepiece", path, data)
        self.kind = "sentencepiece"
        self.model_sha256 = hashlib.sha256(data).hexdigest()
        self._model = model
        pieces = int(model.get_piece_size())
        eos = int(model.eos_id())
        if eos >= 0:
            self.eod_id, self.vocab_size = eos, pieces
        else:
            self.eod_id, self.vocab_size = pieces, pieces + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._model.encode(text, out_type=int), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The texts in one call, no Python between them (the same ids as one text at a time:
        encoding samples nothing). On one thread: the library's thread pool cost ~4 % more CPU
        on a loaded 2-core machine and gained nothing there; `prepare --workers` is what runs
        encodes in parallel (docs/benchmarks.md, "Issue 38")."""
        encoded = self._model.encode(texts, out_type=int, num_threads=1)
        return [np.asarray(ids, dtype=np.int64) for ids in encoded]

    def _decode_piece(self, ids: list[int]) -> str:
        return str(self._model.decode(ids)) if ids else ""


def _first_line(error: Exception) -> str:
    """A library error's first line (or its type, when it has no message) for a one-line error."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


class HFTokenizer(Tokenizer):
    """A local `tokenizers` JSON file; eod is its end-of-text token, else a new last id.

    ``encode`` does not add special tokens (no BOS/EOS post-processing): `prepare` owns document
    boundaries through ``eod_id``.
    """

    def __init__(self, spec: str, path: str) -> None:
        tokenizers = require("tokenizers", "tokenizers", f"tokenizer {spec!r}")
        data = _read_model_file(spec, path, "hf:PATH/TO/tokenizer.json")
        try:
            model = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as error:  # tokenizers raises plain Exception for a bad file.
            raise TokenizerError(
                f"tokenizer {spec!r}: {path} is not a tokenizers JSON file "
                f"({_first_line(error)}); "
                "give a tokenizer.json saved by tokenizers.Tokenizer.save"
            ) from None
        self.spec = spec
        self.name = _file_name("hf", path, data)
        self.kind = "hf"
        self.model_sha256 = hashlib.sha256(data).hexdigest()
        self._model = model
        vocab = model.get_vocab(with_added_tokens=True)
        size = max(
            int(model.get_vocab_size(with_added_tokens=True)), max(vocab.values(), default=-1) + 1
        )
        eod = next((vocab[token] for token in HF_EOD_CANDIDATES if token in vocab), None)
        if eod is not None:
            self.eod_id, self.vocab_size = int(eod), size
        else:
            self.eod_id, self.vocab_size = size, size + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._model.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The texts in one call, on the library's own threads (``RAYON_NUM_THREADS``; none with
        ``TOKENIZERS_PARALLELISM=false``). ``encode_batch_fast`` (tokenizers 0.20+) gives the
        same ids without computing character offsets, which `prepare` never reads."""
        encode = getattr(self._model, "encode_batch_fast", self._model.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def _decode_piece(self, ids: list[int]) -> str:
        return self._model.decode(ids, skip_special_tokens=False) if ids else ""


def load_tokenizer(spec: str) -> Tokenizer:
    """Loads the tokenizer a spec names; raises TokenizerError with the fix for a bad spec."""
    if spec == "bytes":
        return BytesTokenizer()
    kind, sep, path = spec.partition(":")
    if sep and kind == "sentencepiece":
        return SentencePieceTokenizer(spec, os.path.expanduser(path))
    if sep and kind == "hf":
        return HFTokenizer(spec, os.path.expanduser(path))
    raise TokenizerError(f"unknown tokenizer {spec!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")
