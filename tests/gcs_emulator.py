"""`gcp-storage-emulator`, serving suffix byte ranges (`Range: bytes=-N`) as Cloud Storage does.

ArrayRecord's gs:// reader (google-cloud-cpp) opens a shard by reading its last 1 MiB with a
suffix range. The emulator (2026.7.19) parses only `bytes=FIRST-[LAST]` and answers any other
range with the whole object, which ArrayRecord then reads as an empty file ("[0, 1) is of range
of [0, 0)") once the object is larger than 1 MiB. This wrapper rewrites a suffix range into the
`FIRST-` form before the emulator's own download handler runs; everything else is the emulator.
`tests/test_gcs.py::test_the_bare_emulator_ignores_suffix_ranges` pins the upstream behaviour,
so that this file goes when the emulator learns suffix ranges.

    python tests/gcs_emulator.py PORT BUCKET
"""

from __future__ import annotations

import re
import sys

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_SUFFIX = re.compile(r"^\s*bytes=-(?P<length>[0-9]+)\s*$")
_download = objects.download


def download(request, response, storage, *args, **kwargs):
    """The emulator's download, after turning `bytes=-N` into `bytes=max(0, size - N)-`."""
    suffix = _SUFFIX.match(request.get_header("range", "") or "")
    if suffix:
        params = request.params
        try:
            size = len(storage.get_file(params["bucket_name"], params["object_id"]))
        except NotFound:
            size = 0  # the emulator's handler answers 404
        headers = request._request_handler.headers
        del headers["range"]
        headers["range"] = f"bytes={max(0, size - int(suffix['length']))}-"
    return _download(request, response, storage, *args, **kwargs)


if __name__ == "__main__":
    objects.download = download  # before `server` builds its routing table from it
    from gcp_storage_emulator.server import create_server

    port, bucket = sys.argv[1:]
    create_server("127.0.0.1", int(port), in_memory=True, default_bucket=bucket).run()
