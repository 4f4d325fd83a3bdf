"""The ingest layer: corpora in, token stores out (`pipeline prepare`).

`prepare` (local processes) and `prepare_beam` (an Apache Beam pipeline) tokenize corpora
(`corpora` reads the input formats, `chat` renders instruction data, `docstrings` pairs code
with its docstrings) with a tokenizer (`tokenizers`) and write stores with the store layer's
writer, placing documents by a keyed hash (`doc_order`) so both runners write byte-identical
stores. Nothing here imports JAX, Orbax or Grain.
"""
