"""The corpus and tokenizer of the `prepare --workers` figures in docs/benchmarks.md.

    .venv/bin/python benchmarks/prepare_corpus.py DIR

Writes DIR/corpus.jsonl (the standard library's .py sources, cut into documents of 4,000
characters: 8,883 documents, 32.8 MB with CPython 3.11) and DIR/tokenizer.json (a byte-level
BPE of 32,000 ids trained by `tokenizers` on the first 6,000 of them, `<|endoftext|>` its eod),
so that a real subword tokenizer, not the bytes one, sets the cost per token.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

DOCUMENT_CHARS = 4000


def documents() -> list[str]:
    """The stdlib's .py sources (third-party packages left out), in 4,000-character pieces."""
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):  # a few test fixtures are not UTF-8
            continue
        texts.extend(text[i : i + DOCUMENT_CHARS] for i in range(0, len(text), DOCUMENT_CHARS))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    out = parser.parse_args().dir
    out.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = documents()
    with open(out / "corpus.jsonl", "w") as corpus:
        corpus.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts[:6000], trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    print(f"{out}: {len(texts):,} documents, vocabulary {tokenizer.get_vocab_size():,}")


if __name__ == "__main__":
    main()
