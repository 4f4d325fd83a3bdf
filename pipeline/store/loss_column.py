"""The loss mask of a Parquet/Arrow token corpus: a second column, aligned with the ids.

`pipeline index --format parquet` reads one of two kinds of column (docs/in-place-corpora.md;
each a subclass of `LossColumn` in `KINDS`):

* `labels` (`--labels COLUMN`), Hugging Face's convention: each label is the id at its
  position, or -100 where the token carries no loss. Any other label (labels already shifted
  by one, say) is refused: it would move the mask by a token.
* `mask` (`--loss-mask COLUMN`): 0/1 integers or booleans, 0 (false) where the token carries
  no loss; any other value is refused.

Either way each row must be as long as the ids' row at its place. Both give the same
untrained token ranges for the same loss, so the index (and its fingerprint) does not depend on
the kind. The index record names the column and its kind (`loss: {column, kind}`); an index
written before mask columns were read names a labels column alone (`labels: COLUMN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from pipeline.errors import StoreError


class ColumnChunks(Protocol):
    """What a loss column reads of a file (`columns_files.ColumnFile`, which imports this
    module: named by its shape here, not imported)."""

    path: Path
    column: str
    first_rows: np.ndarray

    def chunk(self, index: int, column: str | None = None) -> tuple[np.ndarray, np.ndarray]: ...


IGNORE = -100  # a label that carries no loss (Hugging Face's ignore index)


@dataclass(frozen=True)
class LossColumn:
    """The column that says which tokens carry loss; a kind of it is a subclass, registered
    in `KINDS` by its `kind`."""

    column: str
    kind: ClassVar[str]
    values: ClassVar[str]  # what its list elements must be, as the refusal of another type says

    @staticmethod
    def given(labels: str | None, mask: str | None) -> LossColumn | None:
        """The loss column `pipeline index` was given (--labels or --loss-mask), if any."""
        if labels is not None and mask is not None:
            raise StoreError(
                f"--labels {labels} and --loss-mask {mask}: give one of them, the corpus has "
                "one loss mask"
            )
        if labels is not None:
            return Labels(labels)
        return None if mask is None else Mask(mask)

    @staticmethod
    def of_record(record: dict[str, Any]) -> LossColumn | None:
        """The loss column an index record names (see the module docstring)."""
        if "loss" not in record:  # written before mask columns were read: labels or none
            return None if record["labels"] is None else Labels(record["labels"])
        loss = record["loss"]
        return None if loss is None else KINDS[loss["kind"]](loss["column"])

    def to_record(self) -> dict[str, str]:
        """What the index record keeps of it (`of_record` reads it back)."""
        return {"column": self.column, "kind": self.kind}

    def holds(self, pa: Any, value_type: Any) -> bool:
        """Whether lists of pyarrow `value_type` can be a column of this kind."""
        return pa.types.is_integer(value_type)

    def no_loss(self, values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each token carries no loss, the positions of values this kind refuses)."""
        raise NotImplementedError

    def refusal(self, value: Any, token: Any) -> str:
        """Why `value` (at a token of id `token`) is refused."""
        raise NotImplementedError

    def untrained(
        self, file: ColumnChunks, chunk: int, lengths: np.ndarray, ids: np.ndarray
    ) -> np.ndarray:
        """Per token of chunk `chunk` of `file` (whose rows have `lengths` and flattened
        `ids`): whether it carries no loss. A row of another length, or a value its kind does
        not allow, is refused naming the row (of the file)."""
        row_lengths, values = file.chunk(chunk, self.column)

        def refuse(row: int, why: str) -> StoreError:
            where = f"{file.path}: chunk {chunk}, row {file.first_rows[chunk] + row}"
            return StoreError(f"{where}: {self.column!r} {why}")

        differ = np.flatnonzero(row_lengths != lengths)
        if differ.size:
            raise refuse(
                int(differ[0]),
                f"and {file.column!r} differ in length; a loss column must align with the ids",
            )
        untrained, bad = self.no_loss(values, ids)
        if bad.size:
            at = int(bad[0])
            row = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
            raise refuse(row, self.refusal(values[at], ids[at]))
        return untrained


@dataclass(frozen=True)
class Labels(LossColumn):
    """Hugging Face's labels: the id at its position, or -100 (no loss)."""

    kind: ClassVar[str] = "labels"
    values: ClassVar[str] = "integers"

    def no_loss(self, values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        untrained = values == IGNORE
        return untrained, np.flatnonzero(~untrained & (values != ids))

    def refusal(self, value: Any, token: Any) -> str:
        return (
            f"holds {value} where the id is {token} (shifted labels?); a label is the id at its "
            "position or -100"
        )


@dataclass(frozen=True)
class Mask(LossColumn):
    """A 0/1 (or boolean) mask: 0 where the token carries no loss."""

    kind: ClassVar[str] = "mask"
    values: ClassVar[str] = "0/1 integers or booleans"

    def holds(self, pa: Any, value_type: Any) -> bool:
        return pa.types.is_integer(value_type) or pa.types.is_boolean(value_type)

    def no_loss(self, values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        untrained = values == 0
        return untrained, np.flatnonzero(~untrained & (values != 1))

    def refusal(self, value: Any, token: Any) -> str:
        return f"holds {value}, not 0 or 1 (0 or false: no loss)"


KINDS: dict[str, type[LossColumn]] = {kind.kind: kind for kind in (Labels, Mask)}
