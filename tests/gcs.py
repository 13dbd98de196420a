"""Test support: Cloud Storage on 127.0.0.1, for ``gs://`` run directories.

gcp-storage-emulator serves the Cloud Storage JSON API from memory (buckets;
objects: simple, multipart and resumable uploads, media downloads, listing
with prefix and delimiter). The code under test reaches it unchanged through
``STORAGE_EMULATOR_HOST``, which both gcsfs (``etils.epath``, hence
:mod:`multislice.storage`) and google-cloud-storage honour.

Added here, because the emulator leaves them out (it ignores ``project`` on
``buckets.insert`` and ``buckets.list``, lists every bucket, and gives every
bucket location ``US``): a bucket's project. ``buckets.insert`` records the
``project`` query parameter (required, as the real API answers 400 without it)
and the body's ``location`` and ``iamConfiguration``; ``buckets.list`` answers
only the buckets of its ``project`` whose names start with ``prefix``, as the
JSON API's ``buckets.list`` does
(https://cloud.google.com/storage/docs/json_api/v1/buckets/list: ``project``
required, ``prefix``). So a bucket "owned by another project" is one created
for another project (:class:`FakeGcs` ``owned_by``), which is what gcloud's
ownership check and :func:`multislice.delivery.images.ensure_source_bucket`
look at.

Not modelled (checked against the real service's docs instead): IAM and
authentication (every request is allowed, so a ``GET`` of another project's
bucket answers 200 where the real service may answer 403; on GKE the
trainer's and the pipeline's Google service accounts need
``roles/storage.objectUser`` on the bucket), object versioning and
preconditions, consistency delays, and hierarchical-namespace buckets
(gcsfs's bucket-type probe is switched off with
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, which gcsfs reads when it is
imported: ``tests/conftest.py`` sets it first).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
import urllib.request
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.handlers import buckets as emulator_buckets
from gcp_storage_emulator.server import create_server

#: Environment gcsfs reads at import: no probe of the bucket type through the Storage Control API.
HNS_PROBE_OFF = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

_BAD_REQUEST = {"error": {"code": 400, "message": "Required parameter: project", "errors": [{"reason": "required"}]}}


def _insert_in_project(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    """``POST /b?project=P``: the emulator's insert, then the bucket's project, location and IAM configuration
    recorded (storages that model no projects: the emulator's insert alone)."""
    projects = getattr(storage, "bucket_projects", None)
    project = (request.query.get("project") or [""])[0]
    if projects is not None and not project:
        response.status = HTTPStatus.BAD_REQUEST
        response.json(_BAD_REQUEST)
        return
    emulator_buckets.insert(request, response, storage, *args, **kwargs)
    if projects is None or response.status != HTTPStatus.OK:
        return
    body = request.data or {}
    bucket = storage.buckets[body["name"]]
    projects[body["name"]] = project
    if body.get("location"):
        bucket["location"] = str(body["location"]).upper()
    if body.get("iamConfiguration"):
        bucket["iamConfiguration"] = {**bucket.get("iamConfiguration", {}), **body["iamConfiguration"]}
    response.json(bucket)


def _list_in_project(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    """``GET /b?project=P&prefix=X``: the buckets of ``P`` whose names start with ``X``."""
    projects = getattr(storage, "bucket_projects", None)
    if projects is None:
        emulator_buckets.ls(request, response, storage, *args, **kwargs)
        return
    project = (request.query.get("project") or [""])[0]
    prefix = (request.query.get("prefix") or [""])[0]
    if not project:
        response.status = HTTPStatus.BAD_REQUEST
        response.json(_BAD_REQUEST)
        return
    items = [
        bucket
        for name, bucket in sorted(storage.buckets.items())
        if projects.get(name) == project and name.startswith(prefix)
    ]
    response.json({"kind": "storage#buckets", **({"items": items} if items else {})})


def _model_projects() -> None:
    """Route the emulator's ``/b`` insert and list through the two functions above (its routes are one table
    shared by every server in this process; a storage without ``bucket_projects`` keeps the emulator's own)."""
    for _, handlers in emulator.HANDLERS:
        if handlers.get(emulator.POST) is emulator_buckets.insert:
            handlers[emulator.POST] = _insert_in_project
        if handlers.get(emulator.GET) is emulator_buckets.ls:
            handlers[emulator.GET] = _list_in_project


_model_projects()


class FakeGcs:
    """An in-memory Cloud Storage JSON API on 127.0.0.1 with ``buckets`` created.

    Use as a context manager; :attr:`env` is what a process (this one or a
    child) needs to use it.
    """

    def __init__(
        self, buckets: tuple[str, ...] = ("bucket",), project: str = "test", owned_by: Mapping[str, str] | None = None
    ):
        """``buckets`` are created in ``project``; ``owned_by`` (bucket -> project) creates more, in other
        projects."""
        logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
        self.server = create_server("127.0.0.1", 0, in_memory=True)
        self.server._storage.bucket_projects = {}  # noqa: SLF001 - read by _insert_in_project, _list_in_project
        self.buckets = {**{name: project for name in buckets}, **(owned_by or {})}

    def __enter__(self) -> FakeGcs:
        self.server.start()
        host, port = self.server._api._httpd.server_address  # noqa: SLF001 - the port the OS chose
        self.url = f"http://{host}:{port}"
        for name, project in self.buckets.items():
            request = urllib.request.Request(
                f"{self.url}/storage/v1/b?project={urllib.parse.quote(project)}",
                data=json.dumps({"name": name}).encode(), method="POST", headers={"Content-Type": "application/json"},
            )  # fmt: skip
            urllib.request.urlopen(request, timeout=10).read()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def env(self) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST`` and the gcsfs setting above."""
        return {"STORAGE_EMULATOR_HOST": self.url, **HNS_PROBE_OFF}

    def bucket(self, name: str) -> dict[str, Any] | None:
        """A bucket's resource as the JSON API answers it, with ``project`` (the project it was created in)
        added; None when there is no such bucket."""
        storage = self.server._storage  # noqa: SLF001 - the emulator's state
        found = storage.buckets.get(name)
        return None if found is None else {**found, "project": storage.bucket_projects.get(name)}

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
