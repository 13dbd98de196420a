"""Loopback HTTP fakes for delivery tests: a KFP v2beta1 API server, a GCS bucket endpoint, a webhook receiver.

One server on 127.0.0.1 records every request (method, path, query, JSON or
multipart body) and answers as the services do, so the real clients
(``kfp.Client`` with ``kfp_server_api``; google-cloud-storage through
``STORAGE_EMULATOR_HOST``; ``urllib`` for webhooks) talk to it unchanged.

KFP answers follow the v2beta1 REST API (kfp_server_api 2.17 models, JSON
field names in snake_case as the API server's grpc-gateway writes them):
``/apis/v2beta1/healthz``, ``pipelines`` (list by display_name filter),
``pipelines/upload``, ``pipelines/upload_version`` (a taken version name is a 409, as the server's
unique index), ``pipelines/{id}/versions`` (display_name filter),
``experiments``, ``runs`` (with ``:terminate``), ``recurringruns`` (with ``:enable``/``:disable``);
GCS (JSON API paths): get bucket, get object and its media. Vertex AI
PipelineService over REST (``/v1/projects/*/locations/*/pipelineJobs``:
create, get, ``:cancel``), as aiplatform sends it with ``api_transport="rest"``
and ``api_endpoint`` set to the server; Secret Manager
(REST ``v1/{name}:access``: the payload base64-encoded in ``payload.data``).
Runs are created PENDING; a test may pass ``on_run`` to act as the cluster
(e.g. write the run's reports and mark it SUCCEEDED).
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
import itertools
import json
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

API = "/apis/v2beta1"
CREATED_AT = "2026-11-22T10:00:00Z"


@dataclass
class Request:
    """One recorded request: ``body`` is parsed JSON, ``{field: text}`` for multipart, else None."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    headers: dict[str, str]


@dataclass
class FakeState:
    """What the fake services hold."""

    requests: list[Request] = field(default_factory=list)
    pipelines: dict[str, dict] = field(default_factory=dict)
    versions: dict[str, dict] = field(default_factory=dict)
    templates: dict[str, list[dict]] = field(default_factory=dict)  # version id -> uploaded YAML documents
    experiments: dict[str, dict] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)
    recurring_runs: dict[str, dict] = field(default_factory=dict)
    hooks: list[dict] = field(default_factory=list)
    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)  # GCS (bucket, object name) -> content
    secrets: dict[str, bytes] = field(default_factory=dict)  # Secret Manager secret version name -> payload
    on_run: Callable[[dict], None] | None = None
    kfp_version: str = "2.17.0"  # healthz tag_name, as the API server's TAG_NAME
    on_get_run: Callable[[dict], None] | None = None  # called on each GET of a run: a test moves its state
    vertex_jobs: dict[str, dict] = field(default_factory=dict)  # Vertex AI PipelineJobs by resource name
    on_vertex_job: Callable[[dict], None] | None = None  # called on create and on each GET of a PipelineJob
    hook_status: int = 200
    ids: Any = field(default_factory=lambda: itertools.count(1))

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids):04d}"

    def sent(self, method: str, suffix: str) -> list[Request]:
        """Recorded requests of a method whose path ends with ``suffix``."""
        return [r for r in self.requests if r.method == method and r.path.endswith(suffix)]


def _filter_value(query: dict[str, str]) -> str | None:
    raw = query.get("filter")
    if not raw:
        return None
    predicates = json.loads(raw).get("predicates", [])
    return next((p.get("string_value", p.get("stringValue")) for p in predicates), None)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        kind = self.headers.get("Content-Type", "")
        if kind.startswith("multipart/form-data"):
            message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                f"Content-Type: {kind}\r\n\r\n".encode() + raw
            )
            return {part.get_param("name", header="content-disposition"): part.get_content() for part in
                    message.iter_parts()}  # fmt: skip
        if raw:
            try:
                return json.loads(raw)
            except ValueError:
                return raw.decode("utf-8", "replace")
        return None

    def _answer(self, status: int, payload: Any) -> None:
        raw = isinstance(payload, bytes)
        data = payload if raw else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        body = self._body()
        state = self.server.state
        with self.server.lock:
            state.requests.append(Request(self.command, url.path, query, body, dict(self.headers)))
            status, payload = self._route(self.command, url.path, query, body, state)
        self._answer(status, payload)

    do_GET = do_POST = do_DELETE = do_PATCH = _handle

    def _route(self, method: str, path: str, query: dict, body: Any, s: FakeState) -> tuple[int, Any]:
        if "/storage/v1/b/" in path and "/o/" in path:  # google-cloud-storage: an object's media or metadata
            bucket, _, name = path.split("/storage/v1/b/", 1)[1].partition("/o/")
            data = s.objects.get((bucket, urllib.parse.unquote(name)))
            if data is None:
                return 404, {"error": {"code": 404, "message": "No such object"}}
            if query.get("alt") == "media":
                return 200, data
            return 200, {"bucket": bucket, "name": urllib.parse.unquote(name), "size": str(len(data))}
        if path.startswith("/storage/v1/b/"):  # google-cloud-storage: get bucket
            return 200, {"kind": "storage#bucket", "name": path.rsplit("/", 1)[-1], "location": "US-EAST5"}
        if path.startswith("/v1/projects/") and "/pipelineJobs" in path:
            return self._vertex(method, path.removeprefix("/v1/"), query, body, s)
        if path.startswith("/v1/projects/") and path.endswith(":access") and method == "GET":
            name = path[len("/v1/") : -len(":access")]  # Secret Manager projects.secrets.versions.access
            if name not in s.secrets:
                return 404, {"error": {"code": 404, "message": f"Secret [{name}] not found or has no versions.",
                                       "status": "NOT_FOUND"}}  # fmt: skip
            return 200, {"name": name, "payload": {"data": base64.b64encode(s.secrets[name]).decode()}}
        if path.startswith("/hook"):
            s.hooks.append(body)
            return s.hook_status, {"ok": s.hook_status < 300}
        route = path.removeprefix(API)
        if route == "/healthz":  # the API server's own handler (backend/src/apiserver/main.go), not the proto's
            return 200, {"commit_sha": "0d857b6f8a", "tag_name": s.kfp_version, "multi_user": False,
                         "pipeline_store": "database"}  # fmt: skip
        if route == "/pipelines" and method == "GET":
            name = _filter_value(query)
            namespace = query.get("namespace", "")
            found = [p for p in s.pipelines.values() if (name is None or p["display_name"] == name)
                     and p.get("namespace", "") == namespace]  # fmt: skip
            return 200, ({"pipelines": found, "total_size": len(found)} if found else {})
        if route == "/pipelines/upload" and method == "POST":
            pipeline_id = s.new_id("pipeline")
            name = query.get("name") or query.get("display_name")
            s.pipelines[pipeline_id] = {
                "pipeline_id": pipeline_id,
                "display_name": name,
                "name": name,
                "description": query.get("description", ""),
                "namespace": query.get("namespace", ""),
                "created_at": CREATED_AT,
            }
            self._add_version(s, pipeline_id, name, body)
            return 200, s.pipelines[pipeline_id]
        if route == "/pipelines/upload_version" and method == "POST":
            pipeline_id = query["pipelineid"]
            if pipeline_id not in s.pipelines:
                return 404, {"error_message": f"pipeline {pipeline_id} not found", "code": 5}
            taken = {v["display_name"] for v in s.versions.values() if v["pipeline_id"] == pipeline_id}
            if query.get("name") in taken:  # the API server's unique index on (pipeline, version name)
                return 409, {"error_message": f"version name {query.get('name')} already exists", "code": 6}
            return 200, self._add_version(s, pipeline_id, query.get("name"), body)
        if route.startswith("/pipelines/") and route.endswith("/versions") and method == "GET":
            pipeline_id = route.split("/")[2]
            name = _filter_value(query)
            found = [v for v in s.versions.values() if v["pipeline_id"] == pipeline_id
                     and (name is None or v["display_name"] == name)]  # fmt: skip
            return 200, ({"pipeline_versions": found, "total_size": len(found)} if found else {})
        if route == "/experiments" and method == "GET":
            name = _filter_value(query)
            found = [e for e in s.experiments.values() if name is None or e["display_name"] == name]
            return 200, ({"experiments": found, "total_size": len(found)} if found else {})
        if route == "/experiments" and method == "POST":
            experiment_id = s.new_id("experiment")
            s.experiments[experiment_id] = {**body, "experiment_id": experiment_id, "created_at": CREATED_AT}
            return 200, s.experiments[experiment_id]
        if route == "/runs" and method == "POST":
            run_id = s.new_id("run")
            s.runs[run_id] = {**body, "run_id": run_id, "state": "PENDING", "created_at": CREATED_AT}
            if s.on_run is not None:
                s.on_run(s.runs[run_id])
            return 200, s.runs[run_id]
        if route.startswith("/runs/") and method == "GET":
            run = s.runs.get(route.split("/")[2])
            if run and s.on_get_run is not None:
                s.on_get_run(run)
            return (200, run) if run else (404, {"error_message": "run not found", "code": 5})
        if route.startswith("/runs/") and route.endswith(":terminate") and method == "POST":
            run = s.runs.get(route.split("/")[2].partition(":")[0])
            if not run:
                return 404, {"error_message": "run not found", "code": 5}
            run["state"] = "CANCELED"  # KFP: CANCELING, then CANCELED once its workflow stopped
            return 200, {}
        if route == "/recurringruns" and method == "POST":
            run_id = s.new_id("recurring")
            s.recurring_runs[run_id] = {**body, "recurring_run_id": run_id, "status": "ENABLED",
                                        "created_at": CREATED_AT}  # fmt: skip
            return 200, s.recurring_runs[run_id]
        if route == "/recurringruns" and method == "GET":
            found = list(s.recurring_runs.values())
            return 200, ({"recurringRuns": found, "total_size": len(found)} if found else {})  # its json_name
        if route.startswith("/recurringruns/"):
            run_id, _, action = route.split("/")[2].partition(":")
            if run_id not in s.recurring_runs:
                return 404, {"error_message": f"recurring run {run_id} not found", "code": 5}
            if method == "GET" and not action:
                return 200, s.recurring_runs[run_id]
            if method == "DELETE":
                del s.recurring_runs[run_id]
            elif action in ("enable", "disable"):
                s.recurring_runs[run_id]["mode"] = action.upper()
            return 200, {}
        return 404, {"error_message": f"no route {method} {path}", "code": 5}

    @staticmethod
    def _vertex(method: str, path: str, query: dict, body: Any, s: FakeState) -> tuple[int, Any]:
        """Vertex AI PipelineService over REST (aiplatform with ``api_transport="rest"``): create, get, cancel."""
        if path.endswith("/pipelineJobs") and method == "POST":
            name = f"{path}/{query.get('pipelineJobId') or s.new_id('job')}"
            job = {**body, "name": name, "state": "PIPELINE_STATE_PENDING", "createTime": "2026-11-23T14:00:00Z"}
            s.vertex_jobs[name] = job
            if s.on_vertex_job is not None:
                s.on_vertex_job(job)
            return 200, job
        name, _, action = path.partition(":")
        job = s.vertex_jobs.get(name)
        if job is None:
            return 404, {"error": {"code": 404, "message": f"{name} not found", "status": "NOT_FOUND"}}
        if method == "POST" and action == "cancel":
            job["state"] = "PIPELINE_STATE_CANCELLED"
            return 200, {}
        if s.on_vertex_job is not None:
            s.on_vertex_job(job)
        return 200, job

    @staticmethod
    def _add_version(s: FakeState, pipeline_id: str, name: str | None, body: Any) -> dict:
        version_id = s.new_id("version")
        text = body["uploadfile"] if isinstance(body, dict) else ""
        s.templates[version_id] = [d for d in yaml.safe_load_all(text) if d is not None]
        s.versions[version_id] = {"pipeline_id": pipeline_id, "pipeline_version_id": version_id,
                                  "display_name": name, "name": name, "created_at": CREATED_AT}  # fmt: skip
        return s.versions[version_id]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = FakeState()
        self.lock = threading.Lock()


class FakeServer:
    """Context manager: the fakes on a free loopback port; ``.url``, ``.state``."""

    def __enter__(self) -> FakeServer:
        self._server = _Server()
        self.state = self._server.state
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
