"""A loopback fake of the Cloud Build REST API (v1) for google-cloud-build's REST client.

It serves on 127.0.0.1, over real HTTP, the methods ``multislice images build --cloud-build`` uses
(https://cloud.google.com/build/docs/api/reference/rest/v1/projects.builds/create,
https://cloud.google.com/build/docs/api/reference/rest/v1/operations/get):

- ``POST /v1/projects/P/builds``          create: a long-running Operation whose metadata is the QUEUED build
- ``GET  /v1/operations/build/P/ID``      get operation: DONE after ``polls_until_done`` polls, its response the Build

What it models: the source is read as Cloud Build reads it, from the ``storageSource`` object in
Cloud Storage (the suite's GCS fake, :class:`tests.gcs.FakeGcs`): a missing object fails the build, and
each ``docker build -f <Dockerfile>`` step needs its Dockerfile in the tarball (other steps, such as
``cloudbuild.yaml``'s check, are not run). A successful build pushes every name in ``images`` and reports
it in ``results.images`` with a digest (the SHA-256 of the name and its Dockerfile, so a changed Dockerfile
gives another digest). ``fail_builds`` ends builds with FAILURE and a status detail. A build whose
``serviceAccount`` is set is refused at create (400 INVALID_ARGUMENT with Cloud Build's message, as quoted
in cert-manager/cert-manager#8851 and GoogleCloudPlatform/terraform-google-dataplex-auto-data-quality#39)
unless it names a ``logsBucket``, asks for ``options.logging`` ``CLOUD_LOGGING_ONLY`` or ``NONE``, or for
``options.defaultLogsBucketBehavior`` ``REGIONAL_USER_OWNED_BUCKET``
(https://cloud.google.com/build/docs/securing-builds/configure-user-specified-service-accounts, "Set up
build logs"); a ``serviceAccount`` not of the form ``projects/{PROJECT_ID}/serviceAccounts/{ACCOUNT}``
(REST reference, ``Build.serviceAccount``) is refused too.

What it does not: running the steps (nothing is built; no registry is written), authentication and
IAM (Cloud Build's service account needs Artifact Registry Writer on the repository; a user-specified one
must exist, be usable by the caller, ``iam.serviceAccountUser``, and may write the logs), regional
(``/locations/``) URLs, build logs, cancellation, timeouts, worker pools, substitutions.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.auth.credentials import AnonymousCredentials

_CREATE = re.compile(r"^/v1/projects/([^/]+)/builds$")
_OPERATION = re.compile(r"^/v1/operations/build/([^/]+)/([^/]+)$")
_BUILD_TYPE = "type.googleapis.com/google.devtools.cloudbuild.v1.Build"
_METADATA_TYPE = "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata"
_SERVICE_ACCOUNT = re.compile(r"^projects/[^/]+/serviceAccounts/[^/]+$")
#: Cloud Build's answer to a user-specified service account whose log would go to the default logs bucket.
SERVICE_ACCOUNT_LOGS_MESSAGE = (
    "if 'build.service_account' is specified, the build must either (a) specify 'build.logs_bucket', "
    "(b) use the REGIONAL_USER_OWNED_BUCKET build.options.default_logs_bucket_behavior option, or (c) use "
    "either CLOUD_LOGGING_ONLY / NONE logging options: invalid argument"
)


def enum_name(enum: str, value: Any) -> str | None:
    """A ``BuildOptions`` enum value as its name: google-cloud-build's REST client sends numbers
    (``$alt=json;enum-encoding=int``), a build config or ``curl`` sends names."""
    from google.cloud.devtools import cloudbuild_v1

    if value is None or isinstance(value, str):
        return value
    return getattr(cloudbuild_v1.BuildOptions, enum)(value).name


def _invalid_identity(body: dict[str, Any]) -> str:
    """Why Cloud Build refuses the build's service account and logging (empty: it does not)."""
    account = body.get("serviceAccount")
    if not account:
        return ""
    if not _SERVICE_ACCOUNT.fullmatch(account):
        return f"invalid service account {account!r}: want projects/{{PROJECT_ID}}/serviceAccounts/{{ACCOUNT}}"
    options = body.get("options") or {}
    if (
        body.get("logsBucket")
        or enum_name("LoggingMode", options.get("logging")) in ("CLOUD_LOGGING_ONLY", "NONE")
        or enum_name("DefaultLogsBucketBehavior", options.get("defaultLogsBucketBehavior"))
        == "REGIONAL_USER_OWNED_BUCKET"
    ):
        return ""
    return SERVICE_ACCOUNT_LOGS_MESSAGE


class FakeCloudBuild:
    """The fake's state and scripting hooks; use as a context manager.

    Attributes:
        gcs_url: The Cloud Storage fake the source is read from.
        requests: ``(method, path, body)`` of every request, in order.
        builds: Build id -> the build as REST JSON.
        polls_until_done: GET polls of an operation before it is done.
        fail_builds: A status detail: every build ends FAILURE with it (None: builds succeed).
    """

    def __init__(self, gcs_url: str):
        self.gcs_url = gcs_url
        self.requests: list[tuple[str, str, Any]] = []
        self.builds: dict[str, dict[str, Any]] = {}
        self.polls_until_done = 1
        self.fail_builds: str | None = None
        self._polls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def client(self) -> Any:
        """google-cloud-build's own client, REST transport, pointed at this fake."""
        from google.cloud.devtools import cloudbuild_v1

        host, port = self._server.server_address[:2]
        return cloudbuild_v1.CloudBuildClient(
            transport="rest",
            client_options={"api_endpoint": f"http://{host}:{port}"},
            credentials=AnonymousCredentials(),
        )

    # -- the service --------------------------------------------------------

    def _source(self, build: dict[str, Any]) -> tarfile.TarFile | str:
        storage = build.get("source", {}).get("storageSource", {})
        bucket, name = storage.get("bucket", ""), storage.get("object", "")
        url = f"{self.gcs_url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return tarfile.open(fileobj=io.BytesIO(response.read()), mode="r:gz")
        except urllib.error.HTTPError as error:
            return f"source gs://{bucket}/{name}: HTTP {error.code}"

    def _create(self, project: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not body.get("steps"):
            return 400, {"error": {"code": 400, "message": "invalid build: no steps", "status": "INVALID_ARGUMENT"}}
        if invalid := _invalid_identity(body):
            return 400, {"error": {"code": 400, "message": invalid, "status": "INVALID_ARGUMENT"}}
        build_id = f"b{len(self.builds) + 1:04d}-0000-4000-8000-000000000000"
        build = {
            **body,
            "id": build_id,
            "projectId": project,
            "status": "QUEUED",
            "logUrl": f"https://console.cloud.google.com/cloud-build/builds/{build_id}?project={project}",
        }
        source = self._source(body)
        dockerfiles: dict[str, bytes] = {}
        problem = source if isinstance(source, str) else ""
        if not problem:
            names = set(source.getnames())
            for step in body["steps"]:
                args = step.get("args", [])
                if step.get("entrypoint") or args[:1] != ["build"]:
                    continue  # not a `docker build` (cloudbuild.yaml's check step): nothing to read
                dockerfile = args[args.index("-f") + 1] if "-f" in args else "Dockerfile"
                tagged = args[args.index("-t") + 1] if "-t" in args else ""
                if dockerfile not in names:
                    problem = f"step {step.get('id')}: unable to prepare context: {dockerfile} not found"
                    break
                dockerfiles[tagged] = source.extractfile(dockerfile).read()
        build["_problem"] = problem or self.fail_builds
        build["_digests"] = {
            name: "sha256:" + hashlib.sha256(name.encode() + b"\n" + dockerfiles.get(name, b"")).hexdigest()
            for name in body.get("images", [])
        }
        self.builds[build_id] = build
        operation = {
            "name": f"operations/build/{project}/{build_id}",
            "done": False,
            "metadata": {"@type": _METADATA_TYPE, "build": _public(build)},
        }
        return 200, operation

    def _poll(self, project: str, build_id: str) -> tuple[int, dict[str, Any]]:
        build = self.builds.get(build_id)
        if build is None:
            return 404, {"error": {"code": 404, "message": f"build {build_id} not found", "status": "NOT_FOUND"}}
        self._polls[build_id] = self._polls.get(build_id, 0) + 1
        operation: dict[str, Any] = {"name": f"operations/build/{project}/{build_id}"}
        if self._polls[build_id] < self.polls_until_done:
            build["status"] = "WORKING"
            return 200, {**operation, "done": False, "metadata": {"@type": _METADATA_TYPE, "build": _public(build)}}
        if build["_problem"]:
            build.update(status="FAILURE", statusDetail=build["_problem"])
        else:
            build.update(
                status="SUCCESS",
                results={"images": [{"name": name, "digest": digest} for name, digest in build["_digests"].items()]},
            )
        # Cloud Build's operation for a finished build carries the Build as its response (a failed
        # build too: the status says how it ended).
        return 200, {
            **operation,
            "done": True,
            "metadata": {"@type": _METADATA_TYPE, "build": _public(build)},
            "response": {"@type": _BUILD_TYPE, **_public(build)},
        }

    def _route(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        if method == "POST" and (match := _CREATE.fullmatch(path)):
            return self._create(match.group(1), body or {})
        if method == "GET" and (match := _OPERATION.fullmatch(path)):
            return self._poll(match.group(1), match.group(2))
        return 404, {"error": {"code": 404, "message": f"no route {method} {path}", "status": "NOT_FOUND"}}

    # -- serving -------------------------------------------------------------

    def __enter__(self) -> FakeCloudBuild:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                path = urllib.parse.urlsplit(self.path).path
                with fake._lock:
                    fake.requests.append((self.command, path, body))
                    code, answer = fake._route(self.command, path, body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle  # noqa: N815 - http.server's names

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


def _public(build: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in build.items() if not key.startswith("_")}
