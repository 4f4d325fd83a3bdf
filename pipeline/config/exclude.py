"""`sources.NAME.exclude`: the documents a source leaves out (a take-down, docs/steering.md).

    sources:
      web: {path: ../data/web, packing: best_fit, exclude: takedown.txt}
      # or: exclude: {file: takedown.txt, missing: ignore}

The file lists document ids (`prepare --id-field/--record-ids`), one per line. Surrounding
white space is not part of an id; blank lines and lines that start with `#` are passed over; a
line that starts with `"` is a JSON string (an id with white space, a `#` or a newline). An id
the store does not hold is an error naming the file and line, unless `missing: ignore`.

The file's SHA-256 is part of the source's config (`sha256`): the ledger records it with the
segment, and the segment's data-order fingerprint covers it, so a file edited after a run
recorded it is refused instead of giving past steps other batches. A config may give `sha256`
itself to pin the file.

A recorded file is found by its content, as a store is by its fingerprint: when a ledger's
config is read again after the run's directory moved, a file the recorded path no longer holds
(or holds edited) is looked for among the files a plan is offered (`offered`: the exclude files
of the config in force, and its directory, where a file of the recorded name is tried), and the
one whose SHA-256 is the recorded one is read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.paths import anchored
from pipeline.errors import ConfigError
from pipeline.urls import is_url, location, read_bytes

MISSING = ("error", "ignore")
KEYS = ("file", "missing", "sha256")
LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class ExcludeSpec:
    """An exclude file, its content digest, and what an id the store lacks does."""

    file: Path
    sha256: str
    missing: str = "error"

    def to_json(self) -> dict[str, str]:
        return {"file": str(self.file), "missing": self.missing, "sha256": self.sha256}

    def ids(self) -> Iterator[tuple[int, str]]:
        """(line number, id) of each id of the file, read again and checked against `sha256`."""
        data = _read(self.file)
        if _digest(data) != self.sha256:
            raise ConfigError(_changed(self.file, _digest(data), self.sha256))
        yield from _parse(data, self.file)


def parse_exclude(
    value: Any,
    key: str,
    base_dir: Path | None,
    fail: Callable[[str, str], ConfigError],
    offered: tuple[Path, ...] = (),
) -> ExcludeSpec:
    """`sources.NAME.exclude` (`key`): a file name, or `{file, missing, sha256}`; the file is
    read now, so a missing or malformed one is refused before anything runs. With `sha256`
    given, a file of that content among `offered` stands in for one moved (module docstring)."""
    entry = value if isinstance(value, dict) else {"file": value}
    for name in entry:
        if name not in KEYS:
            raise fail(f"{key}.{name}", f"unknown key (valid keys: {', '.join(KEYS)})")
    file = entry.get("file")
    if not isinstance(file, str) or not file:
        raise fail(f"{key}.file" if isinstance(value, dict) else key, f"expected a file of "
                   f"document ids, got {file!r}")  # fmt: skip
    missing = entry.get("missing", "error")
    if missing not in MISSING:
        raise fail(f"{key}.missing", f"expected error or ignore, got {missing!r}")
    path = _located(file, key, base_dir, fail)
    pinned = entry.get("sha256")
    if pinned is not None and offered:
        path = relocated(path, str(pinned), offered)
    try:
        data = _read(path)
    except ConfigError as error:  # named by the config and key, as every other config error
        raise fail(key, str(error)) from None
    for _ in _parse(data, path):  # a malformed line is refused now
        pass
    digest = _digest(data)
    if pinned is not None and pinned != digest:
        raise fail(f"{key}.sha256", _changed(path, digest, str(pinned)))
    return ExcludeSpec(path, digest, missing)


def _located(
    file: str, key: str, base_dir: Path | None, fail: Callable[[str, str], ConfigError]
) -> Any:
    """The file, absolute (as store paths are): the ledger records it, and `dump --ledger`
    may run from another directory; a relative one in a config read from a URL is refused."""
    return location(file) if is_url(file) else anchored(file, key, base_dir, fail)


def relocated(path: Path, sha256: str, offered: tuple[Path, ...]) -> Path:
    """`path` if it holds content `sha256`, else the first of `offered` that does (a file, or
    the file of `path`'s name in a directory), else `path` (whose read then says what is
    wrong)."""
    candidates = [path] + [c / path.name if c.is_dir() else c for c in offered]
    for candidate in candidates:
        try:
            if _digest(read_bytes(str(candidate))) == sha256:
                return candidate
        except OSError:
            continue
    return path


def exclude_files(sources: Any, home: Path | None) -> tuple[Path, ...]:
    """What a config offers a recorded exclude file that moved (`relocated`): the exclude
    files of its `sources` (`SourceSpec`s) and its directory `home` (None: a URL's)."""
    files = tuple(s.exclude.file for s in sources if s.exclude is not None)
    return files + ((home,) if home is not None else ())


def _changed(path: Path, digest: str, recorded: str) -> str:
    return (
        f"{path} changed since it was recorded (sha256 {digest[:16]}…, recorded "
        f"{recorded[:16]}…): a run replays the ids its ledger recorded; restore the file, or "
        "give the new ids in another file with a declared switch"
    )


def _read(path: Path) -> bytes:
    try:
        return read_bytes(str(path))
    except OSError as error:  # the reason, not Python's "[Errno 2] ...: 'path'" again
        reason = error.strerror or str(error) or type(error).__name__
        raise ConfigError(f"{path}: cannot read the exclude file ({reason})") from None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse(data: bytes, path: Path) -> Iterator[tuple[int, str]]:
    try:
        text = data.decode("utf-8-sig")  # a byte order mark (Notepad) is not part of an id
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 ({error.reason}); write the ids as UTF-8") from None
    # lines end at \n, \r\n or \r only: `str.splitlines` would also cut an id at U+2028,
    # U+0085 or a form feed, and exclude its pieces instead
    for number, line in enumerate(LINE_END.split(text), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"{path} line {number}: a line that starts with '\"' is a JSON string "
                    f"({error.msg})"
                ) from None
            if not line:
                raise ConfigError(f"{path} line {number}: an empty id")
        yield number, line
