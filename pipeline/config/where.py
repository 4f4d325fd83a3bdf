"""Where in a config file a value is: its checks fail with one line naming the file and key."""

from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError


class Where:
    """Checks of one config file's values whose errors name the file and the key (every
    section parser takes one, so each message reads `FILE: KEY: what is wrong`)."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {key}: {message}")

    def keys(self, mapping: dict, allowed: tuple[str, ...], key: str) -> None:
        for name in mapping:
            if name not in allowed:
                place = f"{key}.{name}" if key else str(name)
                raise self.fail(place, f"unknown key (valid keys: {', '.join(allowed)})")

    def integer(self, value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"{value} is beyond the largest supported value, {maximum:,}")
        return value

    def mapping(self, value: Any, key: str) -> dict:
        if not isinstance(value, dict) or not value:
            raise self.fail(key, f"expected a non-empty mapping, got {value!r}")
        return value

    def known(self, name: Any, names: set[str], key: str) -> str:
        if name not in names:
            raise self.fail(
                f"{key}.{name}", f"unknown source (sources: {', '.join(sorted(names))})"
            )
        return name
