"""The feed's statistics as a Prometheus endpoint (`feed: {metrics_port: 9431}`).

A collector turns `DataFeed.stats()` into metrics when the endpoint is scraped, so serving
metrics adds nothing to a step. Names follow Prometheus conventions (base units: seconds,
bytes; `_total` for counters); every sample has the label `process` (the JAX process index),
per-source samples also `source`. The list is docs/observability.md's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pipeline.errors import FeedError
from pipeline.feed.stats import FeedStats, Quantiles

PREFIX = "pipeline_feed_"

# name (without PREFIX), type, help, value: a number, or {source: number}
METRICS: tuple[tuple[str, str, str, Callable[[FeedStats], object]], ...] = (
    ("steps", "counter", "Steps served by this feed", lambda s: s.steps),
    ("next_step", "gauge", "The step the next next() returns", lambda s: s.step),
    ("rows", "counter", "Rows this process served, per source", lambda s: s.rows),
    ("tokens", "counter", "Tokens (rows x seq_len) this process served", lambda s: s.tokens),
    ("read_bytes", "counter", "Token bytes of the windows read", lambda s: s.bytes_read),
    ("ledger_rows", "gauge", "Rows of the whole job since the ledger began",
     lambda s: s.ledger_rows),
    ("ledger_tokens", "gauge", "Tokens of the whole job since the ledger began",
     lambda s: s.ledger_tokens),
    ("source_epoch", "gauge", "Epoch of each source's next window", lambda s: s.epochs),
    ("prefetch_depth_steps", "gauge", "Steps read ahead at most", lambda s: s.prefetch),
    ("prefetch_ready_steps", "gauge", "Steps already read when the last next() began",
     lambda s: s.prefetch_ready),
    ("read_seconds", "summary", "Reader time per step", lambda s: s.read_s),
    ("wait_seconds", "summary", "Time the consumer spent inside next() per step",
     lambda s: s.wait_s),
    ("next_cpu_seconds", "summary", "The consumer thread's CPU time inside next() per step",
     lambda s: s.next_cpu_s),
    ("input_bound_steps", "counter", "Steps whose next() took more than the input-bound share",
     lambda s: s.input_bound_steps),
    ("time_to_batch_seconds", "gauge", "Median reader time per step over the last stats window",
     lambda s: s.time_to_batch_s),
    ("slowest_process", "gauge", "The host with the longest time to batch (-1: none yet)",
     lambda s: s.slowest_process),
    ("slowest_time_to_batch_seconds", "gauge", "The slowest host's time to batch",
     lambda s: s.slowest_time_to_batch_s),
    ("downloaded_bytes", "counter", "Bytes this process downloaded from object storage",
     lambda s: s.downloaded_bytes),
)  # fmt: skip


class _Collector:
    def __init__(self, stats: Callable[[], FeedStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import Metric

        stats = self._stats()
        process = {"process": str(stats.process_index)}
        for name, kind, text, value in METRICS:
            metric = Metric(PREFIX + name, text, kind)
            sample = PREFIX + name + ("_total" if kind == "counter" else "")
            figure = value(stats)
            if isinstance(figure, Quantiles):
                for quantile, number in (("0.5", figure.p50), ("0.99", figure.p99)):
                    metric.add_sample(sample, {**process, "quantile": quantile}, number)
                metric.add_sample(sample + "_sum", process, figure.sum)
                metric.add_sample(sample + "_count", process, figure.count)
            elif isinstance(figure, dict):
                for source, number in sorted(figure.items()):
                    metric.add_sample(sample, {**process, "source": source}, number)
            else:
                metric.add_sample(sample, process, figure)
            yield metric


class MetricsServer:
    """The HTTP server of one feed's registry; `close` stops it and frees the port."""

    def __init__(self, server, thread) -> None:
        self._server, self._thread = server, thread
        self.port = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(stats: Callable[[], FeedStats], port: int) -> MetricsServer:
    """Serve `stats()` (a feed's `DataFeed.stats`) on http://0.0.0.0:`port`/metrics."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise FeedError(
            "feed.metrics_port needs prometheus_client: install the extra pipeline[metrics]"
        ) from None
    registry = CollectorRegistry()
    registry.register(_Collector(stats))
    try:
        return MetricsServer(*start_http_server(port, registry=registry))
    except OSError as error:
        raise FeedError(
            f"feed.metrics_port {port}: cannot serve metrics: {error.strerror}; processes "
            "that share a host need distinct ports (DataFeed(..., metrics_port=...))"
        ) from error
