"""Where a source's windows are in each epoch: shard order, lane ranges, window order.

For epoch `e` of a source, its shards are put in a keyed order and concatenated into the
*epoch stream* of T tokens. The stream is cut into `lanes` equal ranges of Q = T // lanes
tokens; lane `l` owns [l*Q, (l+1)*Q). A window is `seq_len + 1` tokens starting at a multiple of
`seq_len` inside the lane's range (consecutive windows share one token, so every token of the
range is a target once). Every lane has the same W = (Q - 1) // seq_len windows per epoch, so all
lanes roll over together; the few tokens past the last window of a lane are not used in that
epoch, and because the shard order changes every epoch, different tokens fall there each time.

The k-th window a lane draws from the source is window `perm(k % W)` of epoch `k // W`, where
`perm` is a keyed bijection per (seed, source, epoch, lane) (`pipeline.plan.permutation`), so
each window is used exactly once per epoch and any k is computed directly. The shard order of
epoch `e` is the same bijection on the shard indices, keyed per (seed, source, epoch).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.permutation import ROUNDS, permutation, permute, round_keys
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenSpan, TokenStore

# Up to this many windows per lane, the whole window order of an (epoch, lane) is computed once
# (a few ms) and cached, so a draw is a lookup; above, each draw's window is computed on its own.
SMALL_DOMAIN = 1 << 16


class SourceLayout:
    """One source's epochs, lanes and windows, from its store's metadata alone; reading a window
    takes the open store (`read`, `read_into`)."""

    def __init__(self, name: str, meta: StoreMeta, seed: int, seq_len: int, lanes: int) -> None:
        self.name = name
        self.meta = meta
        self.seed = seed
        self.seq_len = seq_len
        self.lanes = lanes
        self.lane_tokens = meta.num_tokens // lanes
        self.windows_per_lane = (self.lane_tokens - 1) // seq_len
        if self.windows_per_lane < 1:
            raise ConfigError(
                f"sources.{name}: seq_len {seq_len} needs at least {seq_len + 1} tokens per lane, "
                f"but {meta.path} has {meta.num_tokens} tokens for {lanes} lanes "
                "(use a smaller seq_len or fewer lanes)"
            )
        self._shard_starts = lru_cache(maxsize=64)(self._epoch_shard_starts)
        self._window_keys = lru_cache(maxsize=1024)(self._lane_keys)
        self._small_permutation = lru_cache(maxsize=256)(self._permutation)

    def epoch_and_window(self, counter: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, ...]:
        """(epoch, window index in the lane, token start in the epoch stream) of draw `counter`."""
        counter = np.asarray(counter, dtype=np.int64)
        lane = np.broadcast_to(np.asarray(lane, dtype=np.int64), counter.shape)
        epoch, k = np.divmod(counter, self.windows_per_lane)
        pairs = list(zip(epoch.ravel().tolist(), lane.ravel().tolist()))
        if self.windows_per_lane <= SMALL_DOMAIN:
            window = np.empty_like(k)
            for e, ln in set(pairs):
                mask = (epoch == e) & (lane == ln)
                window[mask] = self._small_permutation(e, ln)[k[mask]]
        else:  # every draw on its own, all (epoch, lane) keys in one call
            keys = np.array([self._window_keys(e, ln) for e, ln in pairs], dtype=np.uint64)
            window = permute(k, self.windows_per_lane, keys.reshape(*k.shape, ROUNDS))
        start = lane * self.lane_tokens + window * self.seq_len
        return epoch, window, start

    def pieces(self, epoch: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces covering [start, stop) of the epoch stream."""
        order, starts = self._shard_starts(epoch)
        out = []
        position = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            shard = int(order[position])
            lo = start - int(starts[position])
            hi = min(stop, int(starts[position + 1])) - int(starts[position])
            if hi > lo:
                out.append((shard, lo, hi))
            start += hi - lo
            position += 1
        return out

    def read(self, store: TokenStore, epoch: int, start: int) -> TokenSpan:
        """The window of `seq_len + 1` tokens at `start` of the epoch stream, from `store`."""
        spans, offset, doc_starts = [], 0, []
        for shard, lo, hi in self.pieces(epoch, start, start + self.seq_len + 1):
            span = store.read_shard_tokens(shard, lo, hi)
            spans.append(span.tokens)
            doc_starts.append(span.doc_starts + offset)
            offset += hi - lo
        if len(spans) == 1:
            return TokenSpan(spans[0], doc_starts[0])
        return TokenSpan(np.concatenate(spans), np.concatenate(doc_starts))

    def read_into(
        self,
        store: TokenStore,
        out: np.ndarray,
        out_rows: np.ndarray,
        epochs: np.ndarray,
        starts: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Windows at `starts` of `epochs` into rows `out_rows` of `out` [rows, seq_len + 1].

        The batched `read`: a window's pieces (`pieces`) are found for all rows at once and
        read with one `TokenStore.read_pieces_into` call. Returns (row, column) in `out` of
        every document start.
        """
        out_rows = np.asarray(out_rows, dtype=np.int64)
        epochs = np.asarray(epochs, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        length = self.seq_len + 1
        parts: list[tuple[np.ndarray, ...]] = []
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            order, bounds = self._shard_starts(epoch)
            start, rows = starts[mask], out_rows[mask]
            first = np.searchsorted(bounds, start, side="right") - 1
            count = np.searchsorted(bounds, start + length, side="left") - first
            window = np.repeat(np.arange(start.size), count)
            piece = (
                first[window] + np.arange(window.size) - np.repeat(np.cumsum(count) - count, count)
            )
            lo = np.maximum(start[window], bounds[piece])
            hi = np.minimum(start[window] + length, bounds[piece + 1])
            keep = hi > lo  # an empty shard inside a window is no piece
            piece, window, lo, hi = piece[keep], window[keep], lo[keep], hi[keep]
            parts.append((order[piece], lo - bounds[piece], hi - bounds[piece], rows[window],
                          lo - start[window]))  # fmt: skip
        shard, lo, hi, rows, cols = (np.concatenate(column) for column in zip(*parts))
        return store.read_pieces_into(shard, lo, hi, out, rows, cols)

    def shard_order(self, epoch: int) -> np.ndarray:
        return self._shard_starts(epoch)[0]

    def _epoch_shard_starts(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        keys = round_keys(self.seed, "shard-order", self.name, epoch)
        order = permutation(self.meta.num_shards, keys)
        starts = np.concatenate([[0], np.cumsum(self.meta.shard_tokens[order])])
        return order, starts

    def _lane_keys(self, epoch: int, lane: int) -> np.ndarray:
        return round_keys(self.seed, "window-order", self.name, epoch, lane)

    def _permutation(self, epoch: int, lane: int) -> np.ndarray:
        return permutation(self.windows_per_lane, self._window_keys(epoch, lane))
