"""Reaching the cluster's Kubernetes API, as ``plan.spec.cluster.access`` says.

- ``in-cluster``: the pod's ServiceAccount token and CA
  (``/var/run/secrets/kubernetes.io/serviceaccount``), as for KFP installed on
  the same GKE cluster (``kubernetes.config.load_incluster_config``).
- ``kubeconfig``: a context of the kubeconfig file (``$KUBECONFIG`` or
  ``~/.kube/config``; ``cluster.kubeconfig_context``, default the current one).
- ``gke``: the cluster's endpoint and CA certificate from the GKE API
  (google-cloud-container ``ClusterManagerClient.get_cluster``, fields
  ``endpoint`` and ``master_auth.cluster_ca_certificate``) and an OAuth access
  token from google-auth Application Default Credentials, refreshed before it
  expires; as ``gcloud container clusters get-credentials`` does, for Vertex AI
  Pipelines, whose components run outside the cluster.

Nothing here is written into the compiled pipeline: a component resolves its
access when it runs, from the pod's own identity.
"""

from __future__ import annotations

import base64
import tempfile
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


def gke_configuration(cluster: ClusterSpec, *, container: Any | None = None, credentials: Any | None = None):
    """A ``kubernetes.client.Configuration`` for a GKE cluster, resolved through the GKE API.

    Args:
        cluster: The cluster reference (project, location, name).
        container: A ``google.cloud.container_v1.ClusterManagerClient``; default one built on ``credentials``.
        credentials: google-auth credentials; default Application Default Credentials.

    Raises:
        ClusterAccessError: the reference is incomplete, the cluster is not found, or it has no endpoint.
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
    if not found.endpoint:
        raise ClusterAccessError(f"GKE cluster {name} has no endpoint yet (status {found.status.name})", "retry later")
    configuration = k8s.Configuration()
    configuration.host = f"https://{found.endpoint}"
    ca = found.master_auth.cluster_ca_certificate
    if ca:
        with tempfile.NamedTemporaryFile("wb", prefix="gke-ca-", suffix=".pem", delete=False) as handle:
            handle.write(base64.b64decode(ca))
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
