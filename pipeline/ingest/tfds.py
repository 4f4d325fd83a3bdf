"""The `tfds` input format: `tfds:NAME[/CONFIG]:SPLIT`, a TFDS dataset prepared in
`array_record` format, read with `as_data_source` (no TensorFlow needed); feature
`--text-field`. Keys: `tfds:NAME[/CONFIG]:SPLIT:index <i>`, 0-based.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from pipeline.errors import PrepareError
from pipeline.ingest.formats import Document, InputSpec, as_text

NAME = "tfds"
SUFFIXES: tuple[str, ...] = ()
PREFIX = "tfds:"
READS_FIELDS = True
READS_ROWS = False
NO_FIELDS = ""
TFDS_BATCH = 256
TFDS_PATTERN = re.compile(r"^tfds:([A-Za-z0-9_]+(?:/[A-Za-z0-9_.\-]+)?):(\S+)$")


def resolve(argument: str, text_field: str, data_dir: str | None) -> InputSpec:
    tfds_data_dir = data_dir
    match = TFDS_PATTERN.match(argument)
    if not match:
        raise PrepareError(
            f"input {argument!r} is not of the form tfds:NAME[/CONFIG]:SPLIT "
            "(for example tfds:wikipedia/20230601.en:train)"
        )
    name, split = match.group(1), match.group(2)
    data_dir = tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    data_dir = os.path.expanduser(data_dir)
    absl = logging.getLogger("absl")  # TFDS's warnings say what the one-line error below says
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        builder = _tfds_builder(argument, name, data_dir)
        prepared = builder.is_prepared()
    finally:
        absl.setLevel(level)
    if not prepared:
        raise PrepareError(
            f"input {argument!r}: dataset {name} is not prepared in {data_dir}; run "
            f"tfds.builder({name!r}, data_dir=...).download_and_prepare("
            "file_format='array_record') or pass --tfds-data-dir"
        )
    file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
    if file_format != "array_record":
        raise PrepareError(
            f"input {argument!r}: dataset {name} in {data_dir} is stored as {file_format}; "
            "prepare it again with file_format='array_record' (random access without TensorFlow)"
        )
    features = list(builder.info.features.keys())
    if text_field not in features:
        raise PrepareError(
            f"input {argument!r}: dataset {name} has no feature {text_field!r} (features: "
            f"{', '.join(features)}); pass --text-field with the text feature"
        )
    splits = list(builder.info.splits.keys())
    base_split = re.split(r"[\[+]", split, maxsplit=1)[0]
    if base_split not in splits:
        raise PrepareError(
            f"input {argument!r}: dataset {name} has no split {base_split!r} "
            f"(splits: {', '.join(sorted(splits))})"
        )
    return InputSpec(
        "tfds", argument, text_field=text_field, name=name, split=split, data_dir=data_dir
    )


def _tfds_builder(argument: str, name: str, data_dir: str) -> Any:
    import tensorflow_datasets as tfds

    try:
        return tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # DatasetNotFoundError, config errors, unreadable metadata.
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise PrepareError(
            f"input {argument!r}: cannot open TFDS dataset {name} in {data_dir} ({first_line}); "
            "check the name and --tfds-data-dir"
        ) from None


def documents(spec: InputSpec) -> Iterator[Document]:
    builder = _tfds_builder(spec.argument, spec.name, spec.data_dir)
    try:
        source = builder.as_data_source(split=spec.split)
    except Exception as error:
        raise PrepareError(
            f"input {spec.argument!r}: cannot read split {spec.split!r} "
            f"({(str(error).splitlines() or [type(error).__name__])[0]})"
        ) from None
    count = len(source)
    for start in range(0, count, TFDS_BATCH):
        indices = list(range(start, min(start + TFDS_BATCH, count)))
        records = (
            source.__getitems__(indices)
            if hasattr(source, "__getitems__")
            else [source[i] for i in indices]
        )
        for index, record in zip(indices, records, strict=True):
            where = f"{spec.argument} index {index} feature {spec.text_field!r}"
            text = as_text(record[spec.text_field], where)
            yield Document(f"{spec.argument}:index {index}", text)
