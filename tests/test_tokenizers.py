"""Tokenizers on real, locally trained SentencePiece and `tokenizers` files."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import sentencepiece
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import TokenizerError
from pipeline.ingest.tokenizers import EOD_TEXT, Tokenizer, load_tokenizer

TRAIN_TEXT = "\n".join(
    line for topic in sorted(topics)[:20] for line in topics[topic].splitlines() if line.strip()
)[:20_000]
SAMPLE = "The for statement is used to iterate over the elements of a sequence."


def _sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _train_sentencepiece(directory: Path, name: str, **options: object) -> Path:
    corpus = directory / f"{name}.txt"
    corpus.write_text(TRAIN_TEXT, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / name),
        vocab_size=200,
        model_type="bpe",
        character_coverage=1.0,
        normalization_rule_name="identity",
        minloglevel=2,
        **options,
    )
    return directory / f"{name}.model"


def _train_hf(directory: Path, name: str, special_tokens: list[str]) -> Path:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT.splitlines(), trainer)
    path = directory / f"{name}.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("tokenizers")
    return {
        "sp": _train_sentencepiece(directory, "sp"),
        "sp_no_eos": _train_sentencepiece(directory, "sp_no_eos", eos_id=-1),
        "hf": _train_hf(directory, "hf", ["<pad>", "<|endoftext|>"]),
        "hf_two_eos": _train_hf(directory, "hf_two_eos", ["<|eot_id|>", "</s>"]),
        "hf_no_eod": _train_hf(directory, "hf_no_eod", []),
    }


def test_bytes_tokenizer_ids_and_identity() -> None:
    tok = load_tokenizer("bytes")
    assert (tok.spec, tok.name, tok.vocab_size, tok.eod_id) == ("bytes", "bytes", 257, 256)
    ids = tok.encode("hé")
    assert ids.dtype == np.int64
    assert ids.tolist() == [104, 195, 169]
    assert tok.decode([*ids.tolist(), 256, 104]) == f"hé{EOD_TEXT}h"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bytes_round_trip(text: str) -> None:
    tok = load_tokenizer("bytes")
    ids = tok.encode(text)
    assert ids.size == len(text.encode("utf-8"))
    assert (ids < tok.eod_id).all()
    assert tok.decode(ids) == text


def test_bytes_rejects_lone_surrogate() -> None:
    with pytest.raises(TokenizerError, match="surrogate"):
        load_tokenizer("bytes").encode("a\ud800b")


def test_sentencepiece_with_eos(files: dict[str, Path]) -> None:
    path = files["sp"]
    tok = load_tokenizer(f"sentencepiece:{path}")
    model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert tok.name == f"sentencepiece:sp.model@{_sha16(path)}"
    assert tok.eod_id == model.eos_id() >= 0
    assert tok.vocab_size == model.get_piece_size() == 200
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int64 and tok.eod_id not in ids.tolist()
    assert ids.tolist() == model.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([*ids.tolist(), tok.eod_id, *ids.tolist()]) == SAMPLE + EOD_TEXT + SAMPLE


def test_sentencepiece_without_eos_gets_a_new_id(files: dict[str, Path]) -> None:
    tok = load_tokenizer(f"sentencepiece:{files['sp_no_eos']}")
    assert (tok.eod_id, tok.vocab_size) == (200, 201)
    ids = tok.encode(SAMPLE)
    assert int(ids.max()) < 200
    assert tok.decode([tok.eod_id, *ids.tolist()]) == EOD_TEXT + SAMPLE


def test_hf_with_endoftext(files: dict[str, Path]) -> None:
    path = files["hf"]
    tok = load_tokenizer(f"hf:{path}")
    model = tokenizers.Tokenizer.from_file(str(path))
    assert tok.name == f"hf:hf.json@{_sha16(path)}"
    assert tok.eod_id == model.token_to_id("<|endoftext|>") == 1
    assert tok.vocab_size == model.get_vocab_size() == 400
    ids = tok.encode(SAMPLE)
    assert tok.decode([*ids.tolist(), tok.eod_id]) == SAMPLE + EOD_TEXT


def test_hf_eod_candidates_in_order(files: dict[str, Path]) -> None:
    tok = load_tokenizer(f"hf:{files['hf_two_eos']}")
    model = tokenizers.Tokenizer.from_file(str(files["hf_two_eos"]))
    assert tok.eod_id == model.token_to_id("</s>")  # "</s>" comes before "<|eot_id|>".


def test_hf_without_eod_gets_a_new_id(files: dict[str, Path]) -> None:
    tok = load_tokenizer(f"hf:{files['hf_no_eod']}")
    assert (tok.eod_id, tok.vocab_size) == (400, 401)
    assert tok.decode([*tok.encode("x = 1").tolist(), 400]) == "x = 1" + EOD_TEXT


@pytest.fixture(scope="module")
def hf_tokenizer(files: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(f"hf:{files['hf']}")


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_hf_byte_level_round_trip(hf_tokenizer: Tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert ((ids >= 0) & (ids < hf_tokenizer.vocab_size)).all()
    assert hf_tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def file_tokenizers(files: dict[str, Path]) -> dict[str, Tokenizer]:
    return {
        "sp": load_tokenizer(f"sentencepiece:{files['sp']}"),
        "sp_no_eos": load_tokenizer(f"sentencepiece:{files['sp_no_eos']}"),
        "hf": load_tokenizer(f"hf:{files['hf']}"),
    }


@settings(max_examples=25, deadline=None)
@given(st.lists(st.text(), max_size=12), st.sampled_from(["sp", "sp_no_eos", "hf"]))
def test_a_batch_encodes_as_its_texts_one_at_a_time(
    file_tokenizers: dict[str, Tokenizer], texts: list[str], kind: str
) -> None:
    # prepare encodes a task's texts in one encode_batch (native threads): the same ids
    tok = file_tokenizers[kind]
    batch = tok.encode_batch([*texts, SAMPLE])
    assert len(batch) == len(texts) + 1
    for text, ids in zip([*texts, SAMPLE], batch, strict=True):
        assert ids.dtype == np.int64 and ids.tolist() == tok.encode(text).tolist()


@pytest.mark.parametrize("kind", ["bytes", "sp", "sp_no_eos", "hf", "hf_no_eod"])
def test_pickles_as_spec_and_reloads(files: dict[str, Path], kind: str) -> None:
    spec = (
        "bytes"
        if kind == "bytes"
        else f"{'hf' if kind.startswith('hf') else 'sentencepiece'}:{files[kind]}"
    )
    tok = load_tokenizer(spec)
    payload = pickle.dumps(tok)
    assert len(payload) < 1000  # the model itself does not travel.
    copy = pickle.loads(payload)
    assert isinstance(copy, Tokenizer) and type(copy) is type(tok)
    assert (copy.spec, copy.name, copy.vocab_size, copy.eod_id) == (
        tok.spec,
        tok.name,
        tok.vocab_size,
        tok.eod_id,
    )
    assert copy.encode(SAMPLE).tolist() == tok.encode(SAMPLE).tolist()


def test_unpickling_refuses_a_changed_file(files: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_bytes(files["hf"].read_bytes())
    payload = pickle.dumps(load_tokenizer(f"hf:{path}"))
    path.write_bytes(files["hf_no_eod"].read_bytes())
    with pytest.raises(TokenizerError, match="changed"):
        pickle.loads(payload)


@pytest.mark.parametrize("spec", ["gpt2", "byte", "spm:x.model", "", "BYTES"])
def test_unknown_kind_lists_valid_kinds(spec: str) -> None:
    with pytest.raises(TokenizerError, match=r"bytes, sentencepiece:MODEL, hf:TOKENIZER_JSON"):
        load_tokenizer(spec)


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_missing_file_names_the_path(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "nope.bin"
    with pytest.raises(TokenizerError, match=f"{path} does not exist"):
        load_tokenizer(f"{kind}:{path}")
    with pytest.raises(TokenizerError, match="no file given"):
        load_tokenizer(f"{kind}:")
    with pytest.raises(TokenizerError, match="is a directory"):
        load_tokenizer(f"{kind}:{tmp_path}")


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_corrupt_file_names_the_path(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "corrupt.bin"
    path.write_bytes(b"\x00\xffnot a model{")
    with pytest.raises(TokenizerError, match=str(path)):
        load_tokenizer(f"{kind}:{path}")


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_unreadable_file_names_the_path(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "a-directory-not-a-file"
    path.mkdir()  # unreadable as a file for every user, root included
    with pytest.raises(TokenizerError, match=str(path)):
        load_tokenizer(f"{kind}:{path}")


def test_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(TokenizerError, match="id 257"):
        load_tokenizer("bytes").decode([1, 257])
