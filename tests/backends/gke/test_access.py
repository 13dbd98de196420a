"""Cluster access for the GKE backend: the ``gke`` mode resolved through a local fake of the GKE REST API.

google-cloud-container's own REST transport talks to kmock (served on
127.0.0.1) answering ``GET /v1/projects/P/locations/L/clusters/N`` as the GKE
API does (https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters/get).
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from google.api_core.client_options import ClientOptions
from google.cloud import container_v1
from google.oauth2.credentials import Credentials

from multislice.backends.gke import access
from multislice.config import ClusterSpec
from tests.kube_cluster import Served

CA_PEM = b"-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
CLUSTER = ClusterSpec(project="my-proj", location="us-east5", name="tpu-cluster", access="gke")
PATH = "/v1/projects/my-proj/locations/us-east5/clusters/tpu-cluster"


@pytest.fixture
def served():
    server = Served()
    yield server
    server.stop()


def container_client(served: Served, credentials: Credentials) -> container_v1.ClusterManagerClient:
    return container_v1.ClusterManagerClient(
        credentials=credentials, transport="rest", client_options=ClientOptions(api_endpoint=served.url)
    )


def test_gke_access_resolves_endpoint_ca_and_token_through_the_gke_api(served):
    served.cluster[f"get {PATH}"] << {
        "name": "tpu-cluster", "endpoint": "34.118.0.10", "status": "RUNNING",
        "masterAuth": {"clusterCaCertificate": base64.b64encode(CA_PEM).decode()},
    }  # fmt: skip
    credentials = Credentials(token="ya29.test-token")
    api = access.api_client(CLUSTER, container=container_client(served, credentials), credentials=credentials)
    configuration = api.configuration
    assert configuration.host == "https://34.118.0.10"
    assert Path(configuration.ssl_ca_cert).read_bytes() == CA_PEM
    assert configuration.api_key == {"authorization": "Bearer ya29.test-token"}
    request = next(r for r in list(served.cluster) if r.url.path == PATH)
    assert request.headers["Authorization"] == "Bearer ya29.test-token"


def test_gke_access_to_a_missing_cluster_names_the_fields_to_check(served):
    (
        served.cluster[f"get {PATH}"]
        << 404
        << {"error": {"code": 404, "message": "Not found: tpu-cluster.", "status": "NOT_FOUND"}}
    )
    credentials = Credentials(token="t")
    missing = r"(?s)GKE cluster projects/my-proj/.*tpu-cluster not found .*fix: check cluster.project"
    with pytest.raises(access.ClusterAccessError, match=missing):
        access.api_client(CLUSTER, container=container_client(served, credentials), credentials=credentials)


def test_kubeconfig_and_in_cluster_errors_say_what_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(access.ClusterAccessError, match="access kubeconfig: cannot load context ctx"):
        access.api_client(ClusterSpec(access="kubeconfig", kubeconfig_context="ctx"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(access.ClusterAccessError, match="not in a Kubernetes pod with a ServiceAccount"):
        access.api_client(ClusterSpec(access="in-cluster"))
