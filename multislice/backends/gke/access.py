"""Reaching the cluster's Kubernetes API, as ``plan.spec.cluster.access`` says.

- ``in-cluster``: the pod's ServiceAccount token and CA
  (``/var/run/secrets/kubernetes.io/serviceaccount``), as for KFP installed on
  the same GKE cluster (``kubernetes.config.load_incluster_config``).
- ``kubeconfig``: a context of the kubeconfig file (``$KUBECONFIG`` or
  ``~/.kube/config``; ``cluster.kubeconfig_context``, default the current one).
- ``gke``: the cluster's control-plane endpoint from the GKE API
  (google-cloud-container ``ClusterManagerClient.get_cluster``) and an OAuth access
  token from google-auth Application Default Credentials, refreshed before it
  expires; as ``gcloud container clusters get-credentials`` does, for Vertex AI
  Pipelines, whose components run outside the cluster's VPC. Which endpoint:
  :func:`control_plane`.

Nothing here is written into the compiled pipeline: a component resolves its
access when it runs, from the pod's own identity.
"""

from __future__ import annotations

import base64
import tempfile
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from multislice.config import ClusterSpec
from multislice.errors import InputError

#: OAuth scope of GKE's Kubernetes API tokens (as ``gcloud`` requests them).
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


class ClusterAccessError(InputError):
    """The Kubernetes API of the cluster cannot be reached as configured; the message says what to fix."""


def cluster_path(cluster: ClusterSpec) -> str:
    """The GKE API resource name ``projects/P/locations/L/clusters/N``.

    Raises:
        ClusterAccessError: project, location or name is missing.
    """
    missing = [f"cluster.{f}" for f in ("project", "location", "name") if not getattr(cluster, f)]
    if missing:
        raise ClusterAccessError(
            f"{', '.join(missing)} not set: access gke needs the cluster's project, location and name",
            "set them in the profile's cluster section, or use cluster.access in-cluster or kubeconfig",
        )
    return f"projects/{cluster.project}/locations/{cluster.location}/clusters/{cluster.name}"


def _google_credentials(credentials: Any | None) -> Any:
    if credentials is not None:
        return credentials
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        found, _ = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
    except DefaultCredentialsError as error:
        raise ClusterAccessError(
            f"no Google Cloud credentials for cluster.access gke ({error})",
            "run `gcloud auth application-default login` (or give the pipeline job a service account on Vertex AI "
            "Pipelines), or use cluster.access in-cluster or kubeconfig",
        ) from error
    return found


def _bearer(credentials: Any) -> str:
    from google.auth.transport.requests import Request

    if not credentials.valid:
        credentials.refresh(Request())
    return f"Bearer {credentials.token}"


@dataclass(frozen=True)
class ControlPlane:
    """The endpoint the ``gke`` mode reaches a cluster's Kubernetes API through.

    Attributes:
        host: ``https://HOST``.
        ca_pem: The cluster's root CA (PEM bytes) to verify the IP endpoint with; None for the DNS-based
            endpoint, whose certificate is publicly trusted and verified against the default roots.
        kind: ``dns`` or ``ip``.
    """

    host: str
    ca_pem: bytes | None
    kind: str


def control_plane(found: Any, name: str) -> ControlPlane:
    """Which control-plane endpoint of ``found`` (a ``container_v1.Cluster``) a caller outside its VPC can reach.

    1. The DNS-based endpoint (``control_plane_endpoints_config.dns_endpoint_config.endpoint``) when
       ``allow_external_traffic`` is true: reachable from any network that reaches Google Cloud APIs, Vertex
       AI's included, whatever the IP endpoints' private endpoint or authorized networks, with IAM
       ``container.clusters.connect`` checked in front of RBAC
       (https://cloud.google.com/kubernetes-engine/docs/concepts/network-isolation). Its TLS certificate is
       issued by a public CA (Google Trust Services), not by the cluster's CA, so no CA is pinned: the client
       verifies it against its default roots (certifi), as ``kubectl`` does after
       ``gcloud container clusters get-credentials --dns-endpoint``.
    2. Else the public IP endpoint (``endpoint``), verified with ``master_auth.cluster_ca_certificate``, unless
       authorized networks admit only addresses a Vertex AI worker does not have (:func:`authorized_networks_block`):
       then none, with the fix (enable external traffic on the DNS-based endpoint).
    3. Else none: the cluster has only a private IP endpoint (``ip_endpoints_config.enable_public_endpoint``
       false, or the older ``private_cluster_config.enable_private_endpoint``), or no IP endpoint at all.

    Raises:
        ClusterAccessError: case 3, or 2 blocked by authorized networks (the fix: allow external traffic on the
            DNS-based endpoint, or use
            ``cluster.access kubeconfig`` from inside the VPC), or the cluster has no endpoint yet.
    """
    endpoints = found.control_plane_endpoints_config
    dns = endpoints.dns_endpoint_config
    if dns.endpoint and dns.allow_external_traffic:
        return ControlPlane(f"https://{dns.endpoint}", None, "dns")
    ip = endpoints.ip_endpoints_config
    ip_enabled = ip.enabled if "enabled" in ip else True
    if "enable_public_endpoint" in ip:
        public = ip.enable_public_endpoint
    else:  # clusters described before control_plane_endpoints_config: the private cluster settings
        public = not found.private_cluster_config.enable_private_endpoint
    short = name.rsplit("/", 1)[-1]
    location = name.split("/")[3]
    dns_fix = (
        f"allow external traffic on the DNS-based endpoint (`gcloud container clusters update {short} --location "
        f"{location} --enable-dns-access`; the pipeline's Google service account then needs "
        "container.clusters.connect)"
    )
    if ip_enabled and public and found.endpoint:
        blocked = authorized_networks_block(found)
        if blocked:
            raise ClusterAccessError(
                f"GKE cluster {name}'s public IP endpoint {found.endpoint} admits only its authorized networks "
                f"({blocked}), and its DNS-based endpoint "
                + ("does not allow external traffic" if dns.endpoint else "is not enabled")
                + ": Vertex AI Pipelines' components run in a Google-managed network whose addresses are none of "
                "them, so their calls to the Kubernetes API would time out",
                f"{dns_fix}, or run from an authorized network with cluster.access kubeconfig",
            )
        ca = found.master_auth.cluster_ca_certificate
        return ControlPlane(f"https://{found.endpoint}", base64.b64decode(ca) if ca else None, "ip")
    if not found.endpoint and not dns.endpoint:
        raise ClusterAccessError(f"GKE cluster {name} has no endpoint yet (status {found.status.name})", "retry later")
    private = ip.private_endpoint or found.private_cluster_config.private_endpoint
    reachable = f"only a private IP endpoint ({private})" if ip_enabled else "no IP endpoint"
    dns_state = (
        f"its DNS-based endpoint {dns.endpoint} does not allow external traffic" if dns.endpoint
        else "no DNS-based endpoint"
    )  # fmt: skip
    raise ClusterAccessError(
        f"GKE cluster {name} has {reachable} and {dns_state}: a caller outside the cluster's VPC, as Vertex AI "
        "Pipelines' components are, cannot reach its Kubernetes API",
        f"{dns_fix}, or run from inside the VPC with cluster.access kubeconfig "
        f"(`gcloud container clusters get-credentials {short} --location {location} --internal-ip`)",
    )


def authorized_networks_block(found: Any) -> str:
    """Why the public IP endpoint of ``found`` (a ``container_v1.Cluster``) refuses a caller whose address is not
    known in advance, as Vertex AI Pipelines' components are; '' when it admits any.

    GKE's authorized networks (``ip_endpoints_config.authorized_networks_config``, or the older
    ``master_authorized_networks_config`` of a cluster described without it; google-cloud-container
    ``MasterAuthorizedNetworksConfig``): when ``enabled``, the control plane admits over HTTPS only the
    ``cidr_blocks`` and, with ``gcp_public_cidrs_access_enabled``, Google Compute Engine's public IP addresses
    (https://cloud.google.com/kubernetes-engine/docs/concepts/network-isolation). A block of ``0.0.0.0/0`` admits
    any address; Google Cloud's public addresses are taken to admit Vertex AI's workers, which run on Compute
    Engine in a Google-managed project. The DNS-based endpoint is not subject to them (IAM instead), which is why
    :func:`control_plane` prefers it.

    Returns:
        The CIDR blocks that would be admitted (for the message), or '' when the endpoint admits the caller.
    """
    ip = found.control_plane_endpoints_config.ip_endpoints_config
    networks = ip.authorized_networks_config if "authorized_networks_config" in ip else None
    if networks is None:
        networks = found.master_authorized_networks_config
    if not networks.enabled:
        return ""
    if "gcp_public_cidrs_access_enabled" in networks and networks.gcp_public_cidrs_access_enabled:
        return ""
    blocks = [block.cidr_block for block in networks.cidr_blocks]
    if any(block in ("0.0.0.0/0", "::/0") for block in blocks):
        return ""
    return ", ".join(blocks) if blocks else "none listed"


def gke_configuration(cluster: ClusterSpec, *, container: Any | None = None, credentials: Any | None = None):
    """A ``kubernetes.client.Configuration`` for a GKE cluster, resolved through the GKE API.

    Args:
        cluster: The cluster reference (project, location, name).
        container: A ``google.cloud.container_v1.ClusterManagerClient``; default one built on ``credentials``.
        credentials: google-auth credentials; default Application Default Credentials.

    Raises:
        ClusterAccessError: the reference is incomplete, the cluster is not found, or it has no endpoint
            this process can reach (:func:`control_plane`).
    """
    from google.api_core import exceptions as gexc
    from google.cloud import container_v1

    name = cluster_path(cluster)
    google_credentials = _google_credentials(credentials)
    client = container or container_v1.ClusterManagerClient(credentials=google_credentials)
    try:
        found = client.get_cluster(name=name)
    except gexc.NotFound as error:
        raise ClusterAccessError(
            f"GKE cluster {name} not found ({error.message})",
            "check cluster.project, cluster.location (the cluster's region or zone) and cluster.name",
        ) from error
    except gexc.PermissionDenied as error:
        raise ClusterAccessError(
            f"not allowed to read GKE cluster {name} ({error.message})",
            "grant the caller's service account container.clusters.get (roles/container.clusterViewer) on the project",
        ) from error
    endpoint = control_plane(found, name)
    configuration = k8s.Configuration()
    configuration.host = endpoint.host
    if endpoint.ca_pem:
        with tempfile.NamedTemporaryFile("wb", prefix="gke-ca-", suffix=".pem", delete=False) as handle:
            handle.write(endpoint.ca_pem)
        # Configuration's attributes are inferred from their None defaults in __init__ (the client has no stubs).
        configuration.ssl_ca_cert = handle.name  # pyright: ignore[reportAttributeAccessIssue]
    configuration.api_key = {"authorization": _bearer(google_credentials)}

    def refresh(config: k8s.Configuration) -> None:  # called by the client before each request
        if not google_credentials.valid:
            config.api_key = {"authorization": _bearer(google_credentials)}

    # Inferred from its None default in Configuration.__init__ (the client has no stubs).
    configuration.refresh_api_key_hook = refresh  # pyright: ignore[reportAttributeAccessIssue]
    return configuration


def api_client(cluster: ClusterSpec, *, container: Any | None = None, credentials: Any | None = None):
    """A ``kubernetes.client.ApiClient`` for the cluster, by ``cluster.access``.

    Raises:
        ClusterAccessError: the access mode cannot be used here (no ServiceAccount, no kubeconfig
            context, or the GKE reference does not resolve).
    """
    if cluster.access == "in-cluster":
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException as error:
            raise ClusterAccessError(
                f"cluster.access in-cluster, but this process is not in a Kubernetes pod with a ServiceAccount "
                f"({error})",
                "use cluster.access gke (Vertex AI Pipelines, or a machine with gcloud credentials) or kubeconfig",
            ) from error
        return k8s.ApiClient(configuration)
    if cluster.access == "kubeconfig":
        try:
            return k8s_config.new_client_from_config(context=cluster.kubeconfig_context)
        except (k8s_config.ConfigException, FileNotFoundError) as error:
            raise ClusterAccessError(
                f"access kubeconfig: cannot load context {cluster.kubeconfig_context or '(current)'} ({error})",
                "check KUBECONFIG (or ~/.kube/config) and cluster.kubeconfig_context",
            ) from error
    return k8s.ApiClient(gke_configuration(cluster, container=container, credentials=credentials))
