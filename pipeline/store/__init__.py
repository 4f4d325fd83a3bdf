"""The store layer: the token store format, its reader and its writer.

`token_store` reads a prepared store (ArrayRecord shards, document and record indexes, a
checksummed manifest) from a directory or a `gs://` URL, with one module per job: the files'
identities and checksums (`store_files`), a shard's first-use checks (`shard_check`), the
bounded pool of shard readers that retries transient faults (`shard_readers`, `retry`) and
the batched copy of a batch's pieces (`piece_reads`);
`meta` is what planning needs of a store (shard sizes, content fingerprint, tokenizer identity),
read from its manifest alone; `identity` is what makes a store itself (the manifest's checksum,
each shard's sampled records, the tokenizer's identity); `writer` writes one atomically.
Corpora already tokenized are read in place (docs/in-place-corpora.md): `formats` picks the
class by the index `pipeline index` wrote, a Megatron dataset's (`megatron`) or Parquet/Arrow
token columns' (`columns`), both on `inplace`.
Corpora become stores in `pipeline.ingest`. Nothing here imports JAX, Orbax or Grain.
"""

from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore

__all__ = ["StoreMeta", "TokenStore"]
