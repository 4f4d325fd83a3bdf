"""The feed's keys for reading stores in buckets: `feed.cache`, `feed.read_timeout_s` and
`feed.fetch_ahead` (docs/big-mixtures.md), checked with messages that name the file and key."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.where import Where
from pipeline.urls import is_url

REMOTE_KEYS = ("cache", "read_timeout_s", "fetch_ahead")  # of `feed`
CACHE_KEYS = ("dir", "max_gb")
TIMEOUT_S = 60.0  # feed.read_timeout_s's default
FETCH_AHEAD = 4  # feed.fetch_ahead's default
MAX_FETCH_AHEAD = 256  # steps: a bound on what one pass holds in memory


@dataclass(frozen=True)
class RemoteOptions:
    """`FeedOptions.remote`: a host cache (directory, size limit in GB) or None, and the time a
    request to storage may take, and the steps ahead of those read whose blocks are fetched.
    """

    cache: tuple[str, float] | None = None
    read_timeout_s: float = TIMEOUT_S
    fetch_ahead: int = FETCH_AHEAD


def remote_options(feed: dict, where: Where) -> RemoteOptions:
    """The options these keys of `feed` set, checked."""
    return RemoteOptions(
        cache_section(feed, where),
        read_timeout(feed, where),
        where.integer(feed.get("fetch_ahead", FETCH_AHEAD), "feed.fetch_ahead", 0, MAX_FETCH_AHEAD),
    )


def read_timeout(feed: dict, where: Where) -> float:
    """`feed.read_timeout_s`: seconds > 0 a request to storage may take, retries included."""
    timeout = feed.get("read_timeout_s", TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise where.fail("feed.read_timeout_s", f"expected seconds > 0, got {timeout!r}")
    return float(timeout)


def cache_section(feed: dict, where: Where) -> tuple[str, float] | None:
    """`feed.cache: {dir: DIR, max_gb: N}` (both required), or None without one."""
    if "cache" not in feed:
        return None
    raw = feed["cache"]
    if not isinstance(raw, dict):
        raise where.fail("feed.cache", f"expected a mapping with dir and max_gb, got {raw!r}")
    where.keys(raw, CACHE_KEYS, "feed.cache")
    directory, size = raw.get("dir"), raw.get("max_gb")
    if not isinstance(directory, str) or not directory or is_url(directory):
        raise where.fail("feed.cache.dir", f"expected a local directory, got {directory!r}")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise where.fail("feed.cache.max_gb", f"expected a size in GB > 0, got {size!r}")
    return directory, float(size)
