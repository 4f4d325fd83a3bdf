"""`gcp-storage-emulator`, serving two things of Cloud Storage's download API it lacks.

* **Suffix byte ranges** (`Range: bytes=-N`). ArrayRecord's gs:// reader (google-cloud-cpp) opens
  a shard by reading its last 1 MiB with one. The emulator (2026.7.19) parses only
  `bytes=FIRST-[LAST]` and answers any other range with the whole object, which ArrayRecord
  then reads as an empty file ("[0, 1) is of range of [0, 0)") once the object is larger than
  1 MiB. The wrapper rewrites `bytes=-N` into `bytes=FIRST-`.
* **A download of a given generation** (`?generation=G`, which ArrayRecord sends for a path
  `gs://b/o#G`). The emulator serves the live object whatever G is; Cloud Storage answers 404
  for a generation that is not the live one (a bucket without object versioning keeps no
  other). The wrapper answers 404 too.

* **Generation preconditions** (`ifGenerationMatch`, `ifGenerationNotMatch`) and the
  `x-goog-generation` header of a download. The emulator ignores both preconditions (a create
  with `ifGenerationMatch=0` replaces an existing object, a read with `ifGenerationNotMatch=G` of
  generation G answers 200 rather than 304) and names no generation in a download's headers.
  TensorStore (the arrays of an Orbax checkpoint, in an OCDBT database) reads an object's
  generation from that header and conditions its next write of the database's manifest on it:
  missing, it is taken as generation 0, and the write is refused in the client as "Malformed
  StorageGeneration" (docs/tpu.md). The wrapper answers 412 to a failed precondition (304 to a
  read's `ifGenerationNotMatch`), checks it and does the request under one lock (Cloud Storage's
  conditional writes are atomic), and sends `x-goog-generation` and `x-goog-metageneration`.

Everything else is the emulator.
`tests/test_gcs.py::test_the_bare_emulator_lacks_suffix_ranges_and_generations` and
`test_the_bare_emulator_ignores_generation_preconditions` pin the upstream behaviour, so that
the wrapper goes when the emulator learns them.

For tests that count requests, the wrapper can also serve one bucket on several ports (one per
process of a multi-process job, so that a request names the process that made it) and append
each request to a log, one line `PORT METHOD PATH` each.

    python tests/gcs_emulator.py PORT[,PORT...] BUCKET [LOG]   # the wrapped emulator
    with serving() as bucket: ...                 # it (or the bare one) for tests and benchmarks
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from pathlib import Path

_SUFFIX = re.compile(r"^\s*bytes=-(?P<length>[0-9]+)\s*$")


def serve(ports: list[int], bucket: str, log: str | None = None) -> None:
    """Run the emulator with the fix-ups above (imported here: only the server process needs
    the emulator); every port serves the same storage, and `log` gets one line per request."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    replaced = {
        objects.download: _downloading(objects.download),
        objects.get: _conditional(objects.get),
        objects.insert: _conditional(objects.insert),
        objects.delete: _conditional(objects.delete),
    }
    for _, handlers in server.HANDLERS:  # the routing table holds the handlers themselves
        for method, handler in handlers.items():
            handlers[method] = replaced.get(handler, handler)
    for handler, wrapper in replaced.items():  # `get` calls `download`; the router, `insert`
        setattr(objects, handler.__name__, wrapper)
    if log is not None:
        handle = server.Router.handle

        def logged(router, method):
            request = router._request_handler
            with open(log, "a") as lines:  # one write per line: the ports' threads append
                lines.write(f"{request.server.server_port} {method} {request.path}\n")
            return handle(router, method)

        server.Router.handle = logged
    emulator = server.create_server("127.0.0.1", ports[0], in_memory=True, default_bucket=bucket)
    for port in ports[1:]:  # more listeners on the first one's storage
        server.APIThread("127.0.0.1", port, emulator._storage, daemon=True).start()
    emulator.run()


_ONE_AT_A_TIME = threading.RLock()
"""Held while a precondition is checked and its request done: no other port's request between."""


def _live(storage, request) -> dict | None:
    """The live object a request names (its metadata), or None."""
    from gcp_storage_emulator.exceptions import NotFound

    params = request.params
    name = params.get("object_id") or request.query.get("name", [None])[0]
    if name is None and request.query.get("uploadType") == ["multipart"]:
        name = request.data["meta"].get("name")
    try:
        return storage.get_file_obj(params["bucket_name"], name)
    except NotFound:
        return None


def _refusal(request, storage) -> HTTPStatus | None:
    """How Cloud Storage answers a request whose generation precondition fails, or None."""
    match = request.query.get("ifGenerationMatch", [None])[0]
    not_match = request.query.get("ifGenerationNotMatch", [None])[0]
    if match is None and not_match is None:
        return None
    live = _live(storage, request)
    generation = "0" if live is None else str(live["generation"])  # 0: "no live object"
    reading = request.method == "GET"
    if match is not None and match != generation:
        return HTTPStatus.PRECONDITION_FAILED
    if not_match is not None and live is not None and not_match == generation:
        return HTTPStatus.NOT_MODIFIED if reading else HTTPStatus.PRECONDITION_FAILED
    return None


def _conditional(handler):
    """`handler`, refused as Cloud Storage refuses a failed generation precondition."""

    def conditional(request, response, storage, *args, **kwargs):
        with _ONE_AT_A_TIME:
            refusal = _refusal(request, storage)
            if refusal is None:
                return handler(request, response, storage, *args, **kwargs)
            if request.method != "GET":
                _ = request.data  # read the body: the answer must not leave it unread
            response.status = refusal
            return None

    return conditional


def _downloading(download):
    """The emulator's download handler, answering 404 for a generation that is not the live
    one, turning `bytes=-N` into `bytes=max(0, size - N)-` and naming the generation."""

    def downloading(request, response, storage, *args, **kwargs):
        live = _live(storage, request)
        size = 0 if live is None else int(live["size"])  # its metadata: no read of its bytes
        asked = request.query.get("generation", [None])[0]
        if live is not None and asked is not None and asked != str(live["generation"]):
            response.status = HTTPStatus.NOT_FOUND
            return None
        suffix = _SUFFIX.match(request.get_header("range", "") or "")
        if suffix:
            headers = request._request_handler.headers
            del headers["range"]
            headers["range"] = f"bytes={max(0, size - int(suffix['length']))}-"
        if live is not None:
            response["x-goog-generation"] = str(live["generation"])
            response["x-goog-metageneration"] = str(live["metageneration"])
        return download(request, response, storage, *args, **kwargs)

    return _conditional(downloading)


ENDPOINTS = "PIPELINE_TEST_GCS_ENDPOINTS"
"""With `listeners`, the endpoints, comma-separated: process i of a job uses the i-th
(`point_at`)."""


def point_at(endpoint: str) -> None:
    """Point every client of this process at `endpoint`: ArrayRecord's native gs:// reader
    through CLOUD_STORAGE_EMULATOR_ENDPOINT, the Python clients (gcsfs, so etils.epath and
    Orbax's files) through STORAGE_EMULATOR_HOST, TensorStore (Orbax's arrays) through
    TENSORSTORE_GCS_HTTP_URL. gcsfs's probe of a bucket's layout goes to the Storage Control
    API (gRPC), which no emulator serves: GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false leaves it
    out (in a process that imports gcsfs after this) rather than fail, log and retry it at
    every open."""
    os.environ.update(_variables(endpoint))


def _variables(endpoint: str) -> dict[str, str]:
    return {
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": endpoint,
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "NO_GCE_CHECK": "true",  # google-auth: no probe for a GCE metadata server
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


@contextmanager
def serving(bare: bool = False, log: Path | None = None, listeners: int = 1) -> Iterator[str]:
    """A local Cloud Storage API server with one empty bucket, and every client pointed at it
    (`point_at`; the variables are restored after). `bare`: the emulator as released. `log`:
    append each request to that file. `listeners`: serve on that many ports, listed in
    $PIPELINE_TEST_GCS_ENDPOINTS (clients use the first). Yields "gs://BUCKET"."""
    if bare and (log is not None or listeners > 1):
        raise ValueError("the bare emulator serves one port and logs nothing")
    probes = [socket.socket() for _ in range(listeners)]
    for probe in probes:  # held open together: distinct ports
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in probes]
    for probe in probes:
        probe.close()
    bucket = "pipeline-test"  # google-cloud-cpp refuses names under 3 characters
    if bare:
        emulator = Path(sys.executable).parent / "gcp-storage-emulator"
        command = [emulator, "start", "--host=127.0.0.1", f"--port={ports[0]}", "--in-memory"]
        command.append(f"--default-bucket={bucket}")
    else:
        command = [sys.executable, __file__, ",".join(map(str, ports)), bucket]
        command += [str(log)] if log is not None else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoints = [f"http://127.0.0.1:{port}" for port in ports]
    variables = _variables(endpoints[0])
    if listeners > 1:
        variables[ENDPOINTS] = ",".join(endpoints)
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        deadline = time.monotonic() + 30
        for port, endpoint in zip(ports, endpoints, strict=True):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError as error:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"no Cloud Storage server on {endpoint}") from error
                    time.sleep(0.1)
        yield f"gs://{bucket}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    serve([int(port) for port in sys.argv[1].split(",")], sys.argv[2], *sys.argv[3:4])
