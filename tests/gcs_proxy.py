"""A loopback HTTP proxy in front of the GCS emulator that counts what clients download.

Tests and the bench point every client at it (`proxied`): it forwards each request to the
emulator, records its start and end (`time.time()`, comparable across the processes of one
host), method, path and range, and the bytes sent back, and can hold each request `latency`
seconds before forwarding it (a bucket far away), and never answer the requests whose path
`silent` matches (a regular expression: a network that drops them; held until the proxy stops,
at most `SILENT_S`, so no thread outlives the test). `Log.rounds()` counts the
sequential round trips: the longest chain of requests each of which started after the one
before it ended (requests made in parallel overlap, so they count once)."""

from __future__ import annotations

import http.client
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.gcs_emulator import _variables

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "host"}


@dataclass
class Request:
    start: float
    end: float
    method: str
    path: str
    bytes: int


@dataclass
class Log:
    """What went through the proxy since it started (or since `clear`)."""

    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    silenced: list[threading.Thread] = field(default_factory=list)  # the threads holding them

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def downloaded(self) -> int:
        with self.lock:
            return sum(r.bytes for r in self.requests)

    def rounds(self, before: float | None = None) -> int:
        """The longest chain of requests, each started after the previous one ended (of those
        started before `before`, a `time.time()`, if given)."""
        return len(self.chain(before))

    def chain(self, before: float | None = None) -> list[Request]:
        """A longest chain of `rounds`, first request first (to say where the time went)."""
        with self.lock:
            done = sorted(
                (r for r in self.requests if before is None or r.start < before),
                key=lambda r: r.end,
            )
        ends: list[tuple[float, list[Request]]] = []  # (end, longest chain ending there)
        best: list[Request] = []
        for request in done:
            longest = max(
                (chain for end, chain in ends if end <= request.start), key=len, default=[]
            )
            ends.append((request.end, [*longest, request]))
            best = max(best, ends[-1][1], key=len)
        return best


class _Server(ThreadingHTTPServer):
    # a client opens many connections at once: with the default backlog of 5, the kernel drops
    # the rest's SYNs and they connect a second later, a stall no Cloud Storage server makes
    request_queue_size = 1024
    daemon_threads = True


SILENT_S = 60.0  # how long a silenced request is held before its connection is dropped


def _handler(
    target: str, log: Log, latency: float, silent: str | None, stop: threading.Event
) -> type[BaseHTTPRequestHandler]:
    host, port = urlsplit(target).hostname, urlsplit(target).port
    upstream_slots = threading.Semaphore(4)

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            start = time.time()
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            if latency:
                time.sleep(latency)
            if silent is not None and re.search(silent, self.path):
                with log.lock:
                    log.silenced.append(threading.current_thread())
                stop.wait(SILENT_S)  # no answer; then (or once the proxy stops) it drops
                self.close_connection = True
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            with upstream_slots:  # the emulator answers one request at a time, backlog 5
                upstream = http.client.HTTPConnection(host, port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
            self.send_response(answer.status, answer.reason)
            for key, value in answer.getheaders():
                if key.lower() not in _HOP | {"content-length"}:
                    self.send_header(key, value)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            try:
                if self.command != "HEAD":
                    self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client went away
                self.close_connection = True
            path = f"{self.path} {self.headers.get('range', '')}".strip()
            with log.lock:
                log.requests.append(Request(start, time.time(), self.command, path, len(data)))

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

    return Forward


def fresh_clients() -> None:
    """Forget this process's gcsfs clients, so that the next one reads the endpoint anew."""
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()


@contextmanager
def proxied(target: str, latency: float = 0.0, silent: str | None = None) -> Iterator[Log]:
    """A proxy to the emulator at `target` (http://127.0.0.1:PORT), every client of this
    process pointed at it while it runs (`gcs_emulator.point_at`'s variables, restored after);
    requests whose path `silent` matches are never answered."""
    log, stop = Log(), threading.Event()
    server = _Server(("127.0.0.1", 0), _handler(target, log, latency, silent, stop))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    variables = _variables(f"http://127.0.0.1:{server.server_address[1]}")
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    fresh_clients()
    try:
        yield log
    finally:
        stop.set()  # the silenced requests' threads end now, not SILENT_S later
        for thread in list(log.silenced):
            thread.join(timeout=10)
        fresh_clients()
        server.shutdown()
        server.server_close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
