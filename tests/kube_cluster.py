"""Test support: kmock's KubernetesEmulator, extended, served on 127.0.0.1 for the official client.

kmock 0.8's KubernetesEmulator keeps objects in memory and serves create,
get, list, merge-patch (status included) and delete over HTTP. Measured here,
as shipped it (1) treats only ``watch=true`` as a watch, while the official
client sends ``watch=True``; (2) stamps no namespace, uid, resourceVersion,
generation or creationTimestamp; (3) ignores label and field selectors,
``resourceVersion`` and ``timeoutSeconds`` of lists and watches; (4) has no
server-side apply and no ``pods/log``. :class:`Cluster` subclasses it, as its
docstring invites, and adds those, plus two ways to misbehave on purpose:
:meth:`Cluster.fail_next` (answer the next requests with an HTTP error) and
:meth:`Cluster.compact` (forget history: watches from older resourceVersions
get 410 Gone and open watches end).

Deletes honour ``DeleteOptions.preconditions`` (``uid``, ``resourceVersion``:
409 Conflict when the stored object differs, as the API server does).

Creates pass the admission hooks a test installs (:attr:`Cluster.admission`: what a validating webhook or the
API server's feature-gated validation refuses, e.g. :meth:`tests.kube_controllers.Play.feature_gates`), and a
create with ``dryRun=All`` is admitted and answered without being stored.

Not modelled (tests play these parts through the API): admission webhooks
other than those hooks, mutation and defaulting, dry runs of anything but create,
validation against CRD schemas, controllers (JobSet, Job, Kueue, scheduler, kubelet, garbage
collection: deleting a JobSet leaves its pods), strategic-merge and JSON patches (every patch is a JSON merge patch),
field ownership in server-side apply (an apply replaces what it names),
set-based label selectors, authentication (a client's bearer token is taken
as its user name); of watches: bookmarks (``allowWatchBookmarks`` is ignored),
the watch cache and its expiry (history is kept until :meth:`Cluster.compact`),
``resourceVersionMatch`` and ``sendInitialEvents`` (a watch from resourceVersion 0
or none starts with the current objects as ADDED, as the API server's does).
SelfSubjectAccessReviews are answered from the RBAC enforced, not stored
(:meth:`Cluster._self_review`). RBAC is enforced as the API server does it once
:meth:`Cluster.enforce` is given the rendered Role/ClusterRole objects and
bindings (:mod:`tests.kube_rbac`); requests without a token are the
controllers' (the tests' :class:`tests.kube_controllers.Play`) and are allowed.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import threading
import time
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums
from kubernetes import client as k8s

from multislice.backends.gke.client import Kube
from multislice.timings import Timings
from tests.kube_rbac import BEARER_PREFIX, Authorizer, verb_of

#: Waits for tests: polls of 50 ms; deadlines (120 s, an API call retried for 30 s) that a loaded 2-core
#: machine never reaches, longer than a controller script's wait for an event (60 s), so a scenario that
#: goes wrong fails with the script's message. The deadlines a test expects to pass as configured
#: here are ``unschedulable_grace`` and ``job_unschedulable_grace``; tests expecting another to pass
#: shorten it with dataclasses.replace.
FAST = Timings(
    poll_seconds=0.05, report_seconds=0.2, watch_seconds=1, admit_timeout=120, launch_timeout=120,
    unschedulable_grace=0.5, job_unschedulable_grace=0.5, train_timeout=120, readmit_timeout=120,
    verify_timeout=120, api_deadline=30,
    backoff_initial=0.05, backoff_max=0.2,
)  # fmt: skip


def _get_path(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def selected(obj: dict[str, Any], params: dict[str, str]) -> bool:
    """Equality-based ``labelSelector`` and ``fieldSelector`` (``k=v``, ``k==v``, ``k!=v``, comma-joined), and a
    label selector's existence terms (``k``, ``!k``: apimachinery ``pkg/labels/selector.go``, ``Exists`` and
    ``DoesNotExist``)."""
    for param, lookup in (
        ("labelSelector", lambda k: (obj.get("metadata", {}).get("labels") or {}).get(k)),
        ("fieldSelector", lambda k: _get_path(obj, k)),
    ):
        for term in filter(None, (params.get(param) or "").split(",")):
            if "!=" in term:
                key, value = term.split("!=", 1)
                if str(lookup(key)) == value:
                    return False
            elif "=" not in term and param == "labelSelector":
                exists = not term.startswith("!")
                if (lookup(term.lstrip("!").strip()) is not None) != exists:
                    return False
            else:
                key, value = term.replace("==", "=").split("=", 1)
                if lookup(key) is None or str(lookup(key)) != value:
                    return False
    return True


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    """kmock's emulator with watches, metadata stamping, selectors, server-side apply, pod logs and faults."""

    rv: int = 0
    compacted: int = 0
    compactions: int = 0
    history: list = attrs.field(factory=list)  # (rv, resource, event)
    logs: dict = attrs.field(factory=dict)  # (namespace, pod) -> [(RFC 3339 timestamp, line)] as the kubelet keeps
    log_rotations: int = 0
    faults: list = attrs.field(factory=list)  # HTTP statuses for the next requests
    delivered: list = attrs.field(factory=list)  # (plural, resourceVersion) of each watch event sent
    watch_starts: list = attrs.field(factory=list)  # (plural, resourceVersion) each watch request started from
    log_lock: Any = attrs.field(factory=threading.Lock)
    authorizer: Any = None  # tests.kube_rbac.Authorizer once enforce() is called
    admission: list = attrs.field(factory=list)  # (plural, object) -> (HTTP status, message) or None, on CREATE

    def enforce(self, rbac_objects: list[dict[str, Any]]) -> Authorizer:
        """From now on, authorize every request carrying a bearer token by these RBAC objects (as rendered)."""
        self.authorizer = Authorizer(rbac_objects)
        return self.authorizer

    def _user(self, request: Any) -> str | None:
        """The user a request's bearer token names (None: no token, the controllers')."""
        token = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        return token[len(BEARER_PREFIX) :] if token.startswith(BEARER_PREFIX) else None

    @staticmethod
    def _is_self_review(request: Any) -> bool:
        resource = request.resource
        return (
            resource is not None
            and resource.group == "authorization.k8s.io"
            and resource.plural == "selfsubjectaccessreviews"
            and request.action == enums.action.CREATE
        )

    def _self_review(self, request: Any) -> aiohttp.web.Response:
        """Answer a SelfSubjectAccessReview from the RBAC enforced (:meth:`tests.kube_rbac.Authorizer.review`), as
        ``pkg/registry/authorization/selfsubjectaccessreview/rest.go`` does: for the request's own user, the
        review returned with its ``status``, nothing stored. Without RBAC enforced, or for a request without a token
        (the controllers'), everything is allowed, as the emulator allows their requests. A spec without
        ``resourceAttributes`` is refused (422) as ``ValidateSelfSubjectAccessReview`` does for one with neither
        attributes set; non-resource attributes are not modelled.
        """
        body = request.data if isinstance(request.data, dict) else {}
        attributes = (body.get("spec") or {}).get("resourceAttributes")
        if not attributes:
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message="SelfSubjectAccessReview.authorization.k8s.io is invalid: spec.resourceAttributes: Required "
                "value: exactly one of nonResourceAttributes or resourceAttributes must be specified",
            )  # fmt: skip
        user = self._user(request)
        if self.authorizer is None or user is None:
            status = {"allowed": True, "reason": "emulator: RBAC not enforced for this client"}
        else:
            status = self.authorizer.review(user, attributes)
        answer = {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                  "metadata": {"creationTimestamp": None}, "spec": body.get("spec"), "status": status}  # fmt: skip
        return aiohttp.web.json_response(answer, status=201)

    def _authorize(self, request: Any) -> None:
        """Raise 403 Forbidden as the API server would when the request's user may not make it."""
        token = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        if self.authorizer is None or request.resource is None or not token.startswith(BEARER_PREFIX):
            return
        if self._is_self_review(request):
            return  # the default ClusterRole system:basic-user lets every authenticated user create one
        user = token[len(BEARER_PREFIX) :]
        group = request.resource.group or ""
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verbs = [verb_of(request.method.value if hasattr(request.method, "value") else str(request.method),
                         request.name, request.params)]  # fmt: skip
        if "apply-patch" in request.headers.get("Content-Type", ""):
            key = (request.resource, request.namespace, request.name)
            if key not in self._objects or self._objects[key].deleted:
                verbs.append("create")  # patch.go: an apply that creates is also authorized as create
        for verb in verbs:
            if not self.authorizer.allowed(user, verb, group, resource, request.namespace, request.name):
                message = self.authorizer.forbidden_message(user, verb, group, resource, request.namespace,
                                                            request.name)  # fmt: skip
                raise kmock.KubernetesError(status=403, reason="Forbidden", message=message)

    def reads(self, user: str | None) -> int:
        """GET requests served so far to ``user``'s clients (a bearer token; None: the controllers'), watches
        excepted: every get and every list. A waiter on watch events makes them per change, a poller per interval."""
        return sum(
            1
            for request in list(self._requests)
            if request.method == enums.method.GET
            and request.params.get("watch", "").lower() not in ("true", "1")
            and self._user(request) == user
        )

    def fail_next(self, count: int, status: int = 500) -> None:
        """Answer the next ``count`` requests with ``status`` (a Kubernetes Status body)."""
        self.faults.extend([status] * count)

    def compact(self) -> None:
        """Forget history up to now: watches from older resourceVersions get 410 Gone; open watches end."""
        self.compacted = self.rv + 1
        self.compactions += 1

    def watched(self, plural: str) -> int:
        """The newest resourceVersion a watch of ``plural`` (e.g. ``jobsets``) has seen (0: none).

        A watch has seen a version when it was sent an event at it, or when it
        started from it or later (its list already held that state).
        """
        seen = list(self.delivered) + list(self.watch_starts)
        return max((rv for kind, rv in seen if kind == plural), default=0)

    def append_log(self, namespace: str, pod: str, text: str) -> None:
        """Append to a pod's log (what its container printed), each line stamped as the kubelet does (ns)."""
        with self.log_lock:
            entries = self.logs.setdefault((namespace, pod), [])
            for line in text.splitlines(keepends=True):
                now = datetime.datetime.now(datetime.UTC)
                stamp = now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond * 1000 + len(entries) % 1000:09d}Z"
                entries.append((stamp, line))

    def rotate_log(self, namespace: str, pod: str) -> None:
        """Kubelet log rotation: the lines so far leave the log the API serves; open follows of it end."""
        with self.log_lock:
            self.logs[(namespace, pod)] = []
            self.log_rotations += 1

    def _log_lines(self, key: tuple, params: dict[str, str], start: int = 0) -> tuple[str, int]:
        """``(text, entries seen)`` of a pod's log from entry ``start``, with ``timestamps`` and ``sinceTime``."""
        with self.log_lock:
            entries = list(self.logs.get(key, []))
        since = (params.get("sinceTime") or "")[:19]  # metav1.Time: RFC 3339, seconds
        stamped = params.get("timestamps", "").lower() in ("true", "1")
        chosen = [(t, line) for t, line in entries[start:] if not since or t[:19] >= since]
        return "".join(f"{t} {line}" if stamped else line for t, line in chosen), len(entries)

    def _replace(self, request: Any, **changes: Any) -> Any:
        new = attrs.evolve(request, **changes)
        for index, seen in enumerate(self._requests):
            if seen is request:
                self._requests[index] = new
        return new

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if self.faults:
            status = self.faults.pop(0)
            raise kmock.KubernetesError(status=status, reason="InjectedFault", message=f"injected HTTP {status}")
        self._authorize(request)
        if request.resource is None:
            return await super()._handle(request)
        if self._is_self_review(request):
            return self._self_review(request)
        if request.method == enums.method.GET and request.params.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request)
        if request.subresource == "log":
            return await self._log(request)
        apply = "apply-patch" in request.headers.get("Content-Type", "")
        if apply and request.action == enums.action.UPDATE:
            key = (request.resource, request.namespace, request.name)
            if key not in self._objects or self._objects[key].deleted:
                request = self._replace(request, action=enums.action.CREATE, name=None)
        if request.action == enums.action.DELETE:
            self._check_preconditions(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            self._admit(request)
            if request.params.get("dryRun") == "All":
                return self._dry_run(request)
        if request.action in (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE):
            self.rv += 1
            meta = request.data.setdefault("metadata", {}) if isinstance(request.data, dict) else {}
            meta["resourceVersion"] = str(self.rv)
            if request.action == enums.action.CREATE:
                meta.setdefault("namespace", request.namespace) if request.namespace else None
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        response = await super()._handle(request)
        if request.action in (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE):
            self._record(request)
        return response

    def _admit(self, request: Any) -> None:
        """The admission hooks a test installed (:attr:`admission`, what the tests' webhooks and the API server's
        feature-gated validation play): the first refusal is the answer, as a validating webhook's or the API
        server's Status (``reason`` Forbidden for 403, Invalid for 422, else BadRequest)."""
        plural = getattr(request.resource, "plural", "")
        for hook in self.admission:
            refused = hook(plural, request.data)
            if refused is not None:
                status, message = refused
                reason = {403: "Forbidden", 422: "Invalid"}.get(status, "BadRequest")
                raise kmock.KubernetesError(status=status, reason=reason, message=message)

    def _dry_run(self, request: Any) -> aiohttp.web.Response:
        """A create with ``dryRun=All``: admitted (above), answered with the object as it would be stored (a name from
        ``generateName``, metadata stamped), nothing stored, no watch event, no resourceVersion taken
        (k8s.io/apiserver ``pkg/endpoints/handlers/create.go``: the dry-run flag reaches storage, which skips the
        write). A name already taken is 409 AlreadyExists, as storage answers it."""
        obj = copy.deepcopy(request.data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        key = (request.resource, meta.get("namespace"), meta.get("name"))
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists", message=f'"{meta.get("name")}" already '
                                        "exists")  # fmt: skip
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return aiohttp.web.json_response(obj, status=201)

    def _check_preconditions(self, request: Any) -> None:
        """A delete's ``DeleteOptions.preconditions`` (``uid``, ``resourceVersion``), as the API server checks them
        against the stored object: 409 Conflict when one differs (k8s.io/apiserver ``pkg/storage/etcd3/store.go``,
        ``checkPreconditions``, whose ``InvalidObjError`` the registry turns into a Conflict)."""
        wanted = (request.data or {}).get("preconditions") if isinstance(request.data, dict) else None
        key = (request.resource, request.namespace, request.name)
        if not wanted or key not in self._objects or self._objects[key].deleted:
            return
        meta = self._objects[key].raw.get("metadata", {})
        for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if wanted.get(field) is not None and wanted[field] != meta.get(field):
                plural = getattr(request.resource, "plural", "")
                group = getattr(request.resource, "group", "")
                raise kmock.KubernetesError(
                    status=409, reason="Conflict",
                    message=f'Operation cannot be fulfilled on {plural}{"." + group if group else ""} '
                    f'"{request.name}": StorageError: invalid object, Code: 4, Precondition failed: {label} in '
                    f"precondition: {wanted[field]}, {label} in object meta: {meta.get(field)}",
                )  # fmt: skip

    def _record(self, request: Any) -> None:
        data = request.data if isinstance(request.data, dict) else {}
        namespace = request.namespace or data.get("metadata", {}).get("namespace")
        name = request.name or data.get("metadata", {}).get("name")
        key = (request.resource, namespace, name)
        if key not in self._objects:
            return
        stored = self._objects[key]
        kind = {"CREATE": "ADDED", "UPDATE": "MODIFIED", "DELETE": "DELETED"}[request.action.name]
        raw = copy.deepcopy(stored.last.raw if stored.deleted else stored.raw)
        raw.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        if stored.deleted:
            kind = "DELETED"
        self.history.append((self.rv, request.resource, {"type": kind, "object": raw}))

    async def _serve_list(self, request: Any) -> Any:
        try:
            listed = await super()._serve_list(request)
        except kmock.KubernetesResourceNotFoundError:  # no object of it yet: a real server lists nothing
            listed = {"items": []}
        listed["items"] = [item for item in listed["items"] if selected(item, request.params)]
        listed["metadata"] = {"resourceVersion": str(self.rv)}
        return listed

    async def _watch(self, request: Any) -> aiohttp.web.StreamResponse:
        raw_request = request._raw_request
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        since = int(request.params.get("resourceVersion") or 0)
        if since and since < self.compacted:
            gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {since} ({self.compacted})"}  # fmt: skip
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await response.write_eof()
            return response
        deadline = asyncio.get_running_loop().time() + float(request.params.get("timeoutSeconds") or 30)
        compactions = self.compactions
        if not since:  # "most recent": the current objects first
            for item in (await self._serve_list(request))["items"]:
                await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
            since = self.rv
        self.watch_starts.append((getattr(request.resource, "plural", None), since))
        try:
            while asyncio.get_running_loop().time() < deadline and self.compactions == compactions:
                for rv, resource, event in list(self.history):
                    if rv <= since or resource != request.resource:
                        continue
                    since = rv
                    meta = event["object"].get("metadata", {})
                    if request.namespace and meta.get("namespace") != request.namespace:
                        continue
                    if selected(event["object"], request.params):
                        await response.write(json.dumps(event).encode() + b"\n")
                        self.delivered.append((getattr(resource, "plural", None), rv))
                await asyncio.sleep(0.02)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    async def _log(self, request: Any) -> aiohttp.web.StreamResponse:
        key = (request.namespace, request.name)
        pod_key = (request.resource, request.namespace, request.name)
        if pod_key not in self._objects or self._objects[pod_key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        if request.params.get("follow", "").lower() not in ("true", "1"):
            text, _ = self._log_lines(key, request.params)
            lines = text.splitlines(keepends=True)
            tail = int(request.params.get("tailLines") or 0)
            return aiohttp.web.Response(text="".join(lines[-tail:] if tail else lines), content_type="text/plain")
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await response.prepare(request._raw_request)
        sent = 0
        rotations = self.log_rotations
        try:
            while self.log_rotations == rotations:
                text, sent = self._log_lines(key, request.params, sent)
                if text:
                    await response.write(text.encode())
                stored = self._objects[pod_key] if pod_key in self._objects else None
                if (
                    stored is None
                    or stored.deleted
                    or stored.raw.get("status", {}).get("phase") in ("Succeeded", "Failed")
                ):
                    break
                await asyncio.sleep(0.02)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response


class Served:
    """A :class:`Cluster` served on 127.0.0.1 from a background thread, with official clients for it."""

    def __init__(self) -> None:
        #: The user the clients of :meth:`api` authenticate as (a bearer token); None: the controllers (no token).
        self.user: str | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the kmock server did not start")

    def _serve(self) -> None:
        async def main() -> None:
            async with Cluster() as cluster, kmock.Server(cluster) as server:
                self.cluster, self.url = cluster, str(server.url).rstrip("/")
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def stop(self) -> None:
        """Stop the server."""
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def api(self, *, admin: bool = False) -> k8s.ApiClient:
        """A new official ApiClient for this server (plain HTTP), as :attr:`user` (``admin``: no token)."""
        configuration = k8s.Configuration()
        configuration.host = self.url
        user = None if admin else self.user
        if user:
            configuration.api_key = {"authorization": BEARER_PREFIX + user}
        return k8s.ApiClient(configuration)

    def kube(self, namespace: str = "default", timings: Timings = FAST, say: Any = None) -> Kube:
        """The GKE backend's client for this server, with fast test timings."""
        return Kube(self.api(), namespace, timings, say)

    def as_user(self, user: str, rbac_objects: list[dict[str, Any]]) -> None:
        """Enforce ``rbac_objects`` and make :meth:`kube` clients authenticate as ``user``."""
        self.cluster.enforce(rbac_objects)
        self.user = user


def wait_until(predicate: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll ``predicate()`` until truthy; returns its value. Raises AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
