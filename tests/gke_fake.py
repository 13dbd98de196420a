"""A local fake of the GKE API's node pool and operation REST surface, for google-cloud-container's REST client.

It serves, on 127.0.0.1 over real HTTP, the v1 methods provision uses
(https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters.nodePools,
https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.operations):

- ``GET  /v1/projects/P/locations/L/clusters/C``                 get the cluster (:attr:`FakeGke.cluster_info`, and
  ``addonsConfig.rayOperatorConfig.enabled`` from :attr:`FakeGke.ray_operator`)
- ``GET  /v1/projects/P/locations/L/clusters/C/nodePools``       list
- ``GET  /v1/projects/P/locations/L/clusters/C/nodePools/NAME``  get
- ``POST /v1/projects/P/locations/L/clusters/C/nodePools``       create: a CREATE_NODE_POOL operation
- ``DELETE /v1/projects/P/locations/L/clusters/C/nodePools/NAME`` delete: a DELETE_NODE_POOL operation
- ``GET  /v1/projects/P/locations/L/operations/OP``              get operation

Errors come back as Google's JSON error body (``{"error": {"code", "message", "status"}}``),
which the client maps to ``google.api_core.exceptions``. Every request is
recorded with its parsed JSON body, so tests can assert what the real client sent.

What it models: one cluster, described as :attr:`FakeGke.cluster_info` says (its control-plane
endpoints: https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters,
``controlPlaneEndpointsConfig``); a created pool is PROVISIONING until its
operation has been polled ``polls_until_done`` times, then RUNNING (or ERROR
with the operation's error when ``fail_operations`` names the pool); a deleted
pool is STOPPING (GKE's ``NodePool.Status`` while it is deleted) until its
operation has been polled as often, then gone; ``config.resourceLabels`` are
kept as sent.
What it does not: authentication, other clusters' or zonal (``/zones/``) URLs,
field validation the real API does (quotas, machine types per zone,
topology support), node counts changing after creation; the concurrent-operation
limit is only what ``max_running_operations`` scripts.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.auth.credentials import AnonymousCredentials
from google.cloud import container_v1

_POOLS = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)/nodePools(?:/([^/]+))?$")
_CLUSTER = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)$")
_OPERATION = re.compile(r"^/v1/projects/([^/]+)/locations/([^/]+)/operations/([^/]+)$")


class FakeGke:
    """The fake's state and scripting hooks; :meth:`start` serves it.

    Attributes:
        project, location, cluster: The one cluster served; other clusters answer 404.
        pools: Node pool name -> the pool as REST JSON (camelCase).
        operations: Operation name -> operation JSON.
        requests: ``(method, path, body)`` of every request, in order.
        polls_until_done: GET polls of an operation before it is DONE.
        fail_operations: Pool name -> error message its create operation ends with.
        reject_creates: ``(HTTP code, status, message)`` every create answers with, e.g. an invalid argument.
        max_running_operations: When this many operations run, a create gets GKE's 400 FAILED_PRECONDITION
            "Operation ... is currently creating a node pool" (None: no limit).
        cluster_info: The cluster as REST JSON (camelCase) ``clusters.get`` answers; by default a public IP
            endpoint with a CA, as a cluster created without network isolation; :meth:`set_endpoints` changes it.
    """

    def __init__(self, project: str = "my-project", location: str = "us-east5", cluster: str = "tpu-cluster"):
        self.project, self.location, self.cluster = project, location, cluster
        self.pools: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.polls_until_done = 2
        self.fail_operations: dict[str, str] = {}
        self.max_running_operations: int | None = None
        self.reject_creates: tuple[int, str, str] | None = None
        self.cluster_info: dict[str, Any] = {
            "name": cluster, "status": "RUNNING", "endpoint": "34.118.0.10",
            "masterAuth": {"clusterCaCertificate": "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="},
        }  # fmt: skip
        self.ray_operator = False  # the cluster's addonsConfig.rayOperatorConfig.enabled
        self._polls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- scripting ---------------------------------------------------------

    def add_pool(self, pool: container_v1.NodePool, status: str = "RUNNING") -> None:
        """Put an existing pool into the cluster (as if created earlier)."""
        data = json.loads(container_v1.NodePool.to_json(pool, use_integers_for_enums=False))
        data["status"] = status
        self.pools[pool.name] = data

    def set_endpoints(
        self,
        *,
        dns: str | None = None,
        allow_external_traffic: bool = False,
        public_ip: str | None = None,
        private_ip: str | None = None,
        authorized_networks: list[str] | None = None,
        gcp_public_cidrs: bool = False,
    ) -> None:
        """Describe the cluster's control-plane endpoints as GKE does (``controlPlaneEndpointsConfig``).

        ``authorized_networks`` (CIDR blocks; None: the feature off): the IP endpoints' authorized networks,
        ``ipEndpointsConfig.authorizedNetworksConfig`` and its older mirror ``masterAuthorizedNetworksConfig``
        (``enabled``, ``cidrBlocks[].cidrBlock``, ``gcpPublicCidrsAccessEnabled`` from ``gcp_public_cidrs``), as
        ``clusters.get`` returns both (google-cloud-container ``MasterAuthorizedNetworksConfig``).

        ``dns``: the DNS-based endpoint's name (every cluster has one; ``allowExternalTraffic`` says whether
        callers outside the VPC may use it). ``public_ip``/``private_ip``: the IP endpoints; with only
        ``private_ip``, ``enablePublicEndpoint`` is false and ``endpoint`` is the private address; with neither,
        the IP endpoints are disabled (``enabled: false``) and ``endpoint`` is empty.
        """
        config: dict[str, Any] = {}
        if dns:
            config["dnsEndpointConfig"] = {"endpoint": dns, "allowExternalTraffic": allow_external_traffic}
        ip: dict[str, Any] = {"enabled": bool(public_ip or private_ip), "enablePublicEndpoint": bool(public_ip)}
        if public_ip:
            ip["publicEndpoint"] = public_ip
        if private_ip:
            ip["privateEndpoint"] = private_ip
        if authorized_networks is not None:
            networks = {"enabled": True, "cidrBlocks": [{"cidrBlock": block} for block in authorized_networks],
                        "gcpPublicCidrsAccessEnabled": gcp_public_cidrs}  # fmt: skip
            ip["authorizedNetworksConfig"] = networks
            self.cluster_info["masterAuthorizedNetworksConfig"] = networks
        config["ipEndpointsConfig"] = ip
        self.cluster_info["controlPlaneEndpointsConfig"] = config
        self.cluster_info["endpoint"] = public_ip or private_ip or ""

    def client(self) -> container_v1.ClusterManagerClient:
        """google-cloud-container's own client, REST transport, pointed at this fake."""
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return container_v1.ClusterManagerClient(
            transport="rest",
            client_options={"api_endpoint": f"http://{host}:{port}"},
            credentials=AnonymousCredentials(),
        )

    def calls(self, method: str) -> list[tuple[str, Any]]:
        """``(path, body)`` of the recorded requests with this HTTP method."""
        return [(path, body) for m, path, body in self.requests if m == method]

    # -- serving -----------------------------------------------------------

    def start(self) -> FakeGke:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with fake._lock:
                    fake.requests.append((method, path, body))
                    code, reply = fake._route(method, path, body)
                self._reply(code, reply)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._handle("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    @staticmethod
    def _error(code: int, status: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"error": {"code": code, "message": message, "status": status}}

    def _route(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        if (match := _CLUSTER.match(path)) and method == "GET":
            if match.groups() != (self.project, self.location, self.cluster):
                return self._error(404, "NOT_FOUND", f"Not found: {path.removeprefix('/v1/')}.")
            name = f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"
            addons = {"addonsConfig": {"rayOperatorConfig": {"enabled": self.ray_operator}}}
            return 200, {"selfLink": name, **self.cluster_info, **addons}
        if match := _POOLS.match(path):
            project, location, cluster, name = match.groups()
            if (project, location, cluster) != (self.project, self.location, self.cluster):
                return self._error(
                    404, "NOT_FOUND", f"Not found: projects/{project}/locations/{location}/clusters/{cluster}."
                )
            if method == "GET" and name is None:
                return 200, {"nodePools": list(self.pools.values())}
            if method == "GET":
                if name not in self.pools:
                    return self._error(404, "NOT_FOUND", f"Not found: node pool {name!r}.")
                return 200, self.pools[name]
            if method == "POST" and name is None:
                return self._create(body)
            if method == "DELETE" and name is not None:
                return self._delete(name)
        if (match := _OPERATION.match(path)) and method == "GET":
            return self._poll(match.group(3))
        return self._error(404, "NOT_FOUND", f"fake GKE does not serve {method} {path}")

    def _create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.reject_creates:
            return self._error(*self.reject_creates)
        pool = dict(body["nodePool"])
        name = pool["name"]
        if name in self.pools:
            return self._error(409, "ALREADY_EXISTS", f"Already exists: node pool {name!r}.")
        running = [op for op in self.operations.values() if op["status"] != "DONE"]
        if self.max_running_operations is not None and len(running) >= self.max_running_operations:
            return self._error(
                400,
                "FAILED_PRECONDITION",
                f"Operation {running[0]['name']} is currently creating a node pool for cluster {self.cluster}. "
                "Please wait and try again once it is done.",
            )
        pool["status"] = "PROVISIONING"
        self.pools[name] = pool
        op_name = f"operation-{len(self.operations) + 1}"
        target = f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}/nodePools/{name}"
        self.operations[op_name] = {
            "name": op_name,
            "operationType": "CREATE_NODE_POOL",
            "status": "RUNNING",
            "location": self.location,
            "targetLink": f"https://container.googleapis.com/v1/{target}",
            "selfLink": f"https://container.googleapis.com/v1/projects/{self.project}/locations/{self.location}/operations/{op_name}",
        }
        self._polls[op_name] = 0
        return 200, self.operations[op_name]

    def _delete(self, name: str) -> tuple[int, dict[str, Any]]:
        if name not in self.pools:
            return self._error(404, "NOT_FOUND", f"Not found: node pool {name!r}.")
        if self.pools[name]["status"] == "STOPPING":
            return self._error(400, "FAILED_PRECONDITION", f"Node pool {name!r} is being deleted.")
        self.pools[name]["status"] = "STOPPING"
        return 200, self._operation("DELETE_NODE_POOL", name)

    def _operation(self, kind: str, name: str) -> dict[str, Any]:
        op_name = f"operation-{len(self.operations) + 1}"
        target = f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}/nodePools/{name}"
        self.operations[op_name] = {
            "name": op_name,
            "operationType": kind,
            "status": "RUNNING",
            "location": self.location,
            "targetLink": f"https://container.googleapis.com/v1/{target}",
            "selfLink": f"https://container.googleapis.com/v1/projects/{self.project}/locations/{self.location}/operations/{op_name}",
        }
        self._polls[op_name] = 0
        return self.operations[op_name]

    def finish_deletes(self) -> None:
        """Every DELETE_NODE_POOL operation done: its pool is gone (as GKE's would be, once drained)."""
        with self._lock:
            for op in self.operations.values():
                if op["operationType"] == "DELETE_NODE_POOL" and op["status"] != "DONE":
                    op["status"] = "DONE"
                    self.pools.pop(op["targetLink"].rsplit("/", 1)[1], None)

    def _poll(self, op_name: str) -> tuple[int, dict[str, Any]]:
        if op_name not in self.operations:
            return self._error(404, "NOT_FOUND", f"Not found: operation {op_name}.")
        op = self.operations[op_name]
        self._polls[op_name] += 1
        if op["status"] != "DONE" and op["operationType"] == "DELETE_NODE_POOL":
            if self._polls[op_name] >= self.polls_until_done:
                op["status"] = "DONE"
                self.pools.pop(op["targetLink"].rsplit("/", 1)[1], None)
            return 200, op
        if op["status"] != "DONE" and self._polls[op_name] >= self.polls_until_done:
            pool = self.pools[op["targetLink"].rsplit("/", 1)[1]]
            op["status"] = "DONE"
            if pool["name"] in self.fail_operations:
                message = self.fail_operations[pool["name"]]
                op["error"] = {"code": 8, "message": message}
                op["statusMessage"] = message
                pool["status"] = "ERROR"
                pool["statusMessage"] = message
            else:
                pool["status"] = "RUNNING"
        return 200, op
