"""Test support: Cloud Storage on 127.0.0.1, for ``gs://`` run directories.

gcp-storage-emulator serves the Cloud Storage JSON API from memory (buckets;
objects: simple, multipart and resumable uploads, media downloads, listing
with prefix and delimiter). The code under test reaches it unchanged through
``STORAGE_EMULATOR_HOST``, which both gcsfs (``etils.epath``, hence
:mod:`multislice.storage`) and google-cloud-storage honour.

Not modelled (checked against the real service's docs instead): IAM and
authentication (every request is allowed; on GKE the trainer's and the
pipeline's Google service accounts need ``roles/storage.objectUser`` on the
bucket), object versioning and preconditions, consistency delays, and
hierarchical-namespace buckets (gcsfs's bucket-type probe is switched off
with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, which gcsfs reads when it is
imported: ``tests/conftest.py`` sets it first).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
import urllib.request

from gcp_storage_emulator.server import create_server

#: Environment gcsfs reads at import: no probe of the bucket type through the Storage Control API.
HNS_PROBE_OFF = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class FakeGcs:
    """An in-memory Cloud Storage JSON API on 127.0.0.1 with ``buckets`` created.

    Use as a context manager; :attr:`env` is what a process (this one or a
    child) needs to use it.
    """

    def __init__(self, buckets: tuple[str, ...] = ("bucket",)):
        logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
        self.server = create_server("127.0.0.1", 0, in_memory=True)
        self.buckets = buckets

    def __enter__(self) -> FakeGcs:
        self.server.start()
        host, port = self.server._api._httpd.server_address  # noqa: SLF001 - the port the OS chose
        self.url = f"http://{host}:{port}"
        for name in self.buckets:
            request = urllib.request.Request(
                f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(), method="POST",
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            urllib.request.urlopen(request, timeout=10).read()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def env(self) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST`` and the gcsfs setting above."""
        return {"STORAGE_EMULATOR_HOST": self.url, **HNS_PROBE_OFF}

    def names(self, bucket: str = "bucket", prefix: str = "") -> list[str]:
        """Object names in a bucket under ``prefix``, sorted."""
        query = f"prefix={urllib.parse.quote(prefix)}" if prefix else ""
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as response:
            return sorted(item["name"] for item in json.load(response).get("items", []))

    def read(self, name: str, bucket: str = "bucket") -> bytes:
        """An object's bytes (a media download)."""
        quoted = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=10) as response:
            return response.read()
