"""Shared fixtures: real tokenizer files and a real TFDS dataset, built in temporary directories."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics

import pytest
from hypothesis import settings

from tests.gcs_emulator import serving

# No per-example time limit: the suite runs its files in parallel on a shared machine, where a
# deadline is a timed assert that the load decides (a property's example took 390 ms once).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# Every test process simulates 8 CPU devices; this runs before any test imports JAX's backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with multi-process tests first, each file's tests kept together and in order.

    `make test` runs the files on every core (pytest-xdist, `--dist loadfile`: a file's module
    fixtures, the expensive launches they share, are set up once). Starting the long files
    first keeps one of them from running alone at the end while the other workers idle."""
    slow = {item.path for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within stays


@pytest.fixture(autouse=True, scope="session")
def packing_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """best_fit packings are kept in a session directory, not the user's cache (workers started
    by tests inherit it)."""
    directory = tmp_path_factory.mktemp("packings")
    yield from _session_env({"PIPELINE_PACKING_CACHE": str(directory)}, directory)


@pytest.fixture(autouse=True, scope="session")
def manifest_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Manifest summaries (`meta_cache`) too: a session directory, not the user's cache."""
    directory = tmp_path_factory.mktemp("manifests")
    yield from _session_env({"PIPELINE_MANIFEST_CACHE": str(directory)}, directory)


COMPILATION_CACHE = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,  # the trainer's are many small ones
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
"""JAX's persistent compilation cache, for the test processes and the processes tests start
(trainers, workers): a cold launch of the trainer compiled the same ~80 small programs as every
other, about half of its 10 s. A hit loads the executable an earlier compilation wrote, so what
it computes is the same. No size limit: with one, every write lists the whole cache (~0.1 s at
2,000 entries). An entry read while another process writes it fails to decompress: JAX warns
and compiles it (as a miss), it never runs a part of one."""


@pytest.fixture(autouse=True, scope="session")
def compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache for the run, shared by its xdist workers (their base temporary directories
    are in the run's), empty at the start: a run compiles each program once."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "jax-cache"
    directory.mkdir(exist_ok=True)
    settings = {**COMPILATION_CACHE, "jax_compilation_cache_dir": str(directory)}
    if "jax" in sys.modules:  # imported as the tests were collected: it read its environment
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)
    yield from _session_env({k.upper(): str(v) for k, v in settings.items()}, directory)


def _session_env(variables: dict[str, str], directory: Path) -> Iterator[Path]:
    """Set `variables` in the environment while the session runs; yields `directory`."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    yield directory
    for name, value in previous.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value


FIXTURE_TRAIN_TEXT = "\n".join(
    line for topic in sorted(topics)[:20] for line in topics[topic].splitlines() if line.strip()
)[:20_000]
"""Text the fixture tokenizers are trained on (the Python docs: no download)."""

TFDS_TEXTS = [f"tfds document {i} — ünïcode {'x' * i}" for i in range(9)]
"""The documents of the `store_text` TFDS dataset, by index."""


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real SentencePiece BPE model (vocab 200, eos `</s>` = id 2) trained in a tmp dir."""
    import sentencepiece

    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "train.txt"
    corpus.write_text(FIXTURE_TRAIN_TEXT, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "sp"),
        vocab_size=200,
        model_type="bpe",
        character_coverage=1.0,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return directory / "sp.model"


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE `tokenizer.json` (vocab 300) with `<|endoftext|>` as id 1."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(FIXTURE_TRAIN_TEXT.splitlines(), trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tfds_texts() -> list[str]:
    """The texts of the `store_text` dataset in `tfds_text_dir`, by index."""
    return list(TFDS_TEXTS)


@pytest.fixture(scope="session")
def tfds_text_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A TFDS data dir holding `store_text` (split train = TFDS_TEXTS) in array_record format."""
    import tensorflow_datasets as tfds

    class StoreText(tfds.core.GeneratorBasedBuilder):
        """A real TFDS dataset, prepared in array_record format, read back without TensorFlow."""

        # A one-part module name: TFDS then looks for no checksums file beside the class (for a
        # module inside a package it would need the `importlib_resources` backport).
        __module__ = "store_text_dataset"
        VERSION = tfds.core.Version("1.0.0")

        def _info(self) -> tfds.core.DatasetInfo:
            features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager: object) -> dict[str, object]:
            return {"train": self._generate_examples()}

        def _generate_examples(self) -> Iterator[tuple[int, dict[str, str]]]:
            for i, text in enumerate(TFDS_TEXTS):
                yield i, {"text": text}

    data_dir = str(tmp_path_factory.mktemp("tfds"))
    StoreText(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return data_dir


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """A real local Cloud Storage API server (gcp-storage-emulator, taught suffix byte ranges:
    tests/gcs_emulator.py) holding one empty bucket, for the session. Returns "gs://BUCKET"."""
    # gcsfs asks the (unemulated) storage-control API for each bucket's type, warns, and falls
    # back to the plain JSON API that the emulator serves: keep that one warning out of the logs.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    with serving() as bucket:
        yield bucket
