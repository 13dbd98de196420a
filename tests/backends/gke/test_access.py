"""Cluster access for the GKE backend: the ``gke`` mode resolved through a local fake of the GKE REST API.

google-cloud-container's own REST transport talks to kmock (served on
127.0.0.1) answering ``GET /v1/projects/P/locations/L/clusters/N`` as the GKE
API does (https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters/get),
or to tests/gke_fake.py, whose cluster's control-plane endpoints (DNS-based,
public or private IP) a test sets; the DNS-based endpoint's front end is an
HTTPS server with a certificate from a CA other than the cluster's.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.api_core.client_options import ClientOptions
from google.cloud import container_v1
from google.oauth2.credentials import Credentials
from kubernetes import client as k8s
from kubernetes.client import rest as k8s_rest

from multislice.backends.gke import access
from multislice.config import ClusterSpec
from tests.gke_fake import FakeGke
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


# -- which control-plane endpoint: against the fake GKE API (tests/gke_fake.py) ------------------------------------

DNS = "gke-0123456789abcdef0123-0123456789ab.us-east5.gke.goog"


@pytest.fixture
def gke():
    fake = FakeGke(project="my-proj", location="us-east5", cluster="tpu-cluster").start()
    yield fake
    fake.stop()


def _pki(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A "public" root CA (standing for the default roots), a leaf for ``localhost`` it signs, and an unrelated
    cluster CA (standing for GKE's cluster root CA). Returns (public CA pem, leaf cert, leaf key, cluster CA pem)."""
    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool, san: str | None = None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem(cert) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    public_key, leaf_key, cluster_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    public_ca = certificate("test public root", public_key, "test public root", public_key, ca=True)
    leaf = certificate("localhost", leaf_key, "test public root", public_key, ca=False, san="localhost")
    cluster_ca = certificate("cluster root", cluster_key, "cluster root", cluster_key, ca=True)
    paths = [tmp_path / n for n in ("public-ca.pem", "leaf.pem", "leaf.key", "cluster-ca.pem")]
    paths[0].write_bytes(pem(public_ca))
    paths[1].write_bytes(pem(leaf))
    paths[2].write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    paths[3].write_bytes(pem(cluster_ca))
    return paths[0], paths[1], paths[2], paths[3]


@pytest.fixture
def dns_front_end(tmp_path):
    """An HTTPS server on localhost with a publicly issued certificate, as the DNS-based endpoint's front end is.

    Answers ``GET /version`` and records each request's Authorization header.
    """
    public_ca, leaf, key, cluster_ca = _pki(tmp_path)
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({
                "major": "1", "minor": "33", "gitVersion": "v1.33.2-gke.1", "gitCommit": "0" * 40,
                "gitTreeState": "clean", "buildDate": "2026-06-01T00:00:00Z", "goVersion": "go1.24",
                "compiler": "gc", "platform": "linux/amd64",
            }).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(leaf, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"host": f"localhost:{server.server_address[1]}", "public_ca": public_ca, "cluster_ca": cluster_ca,
           "seen": seen}  # fmt: skip
    server.shutdown()
    server.server_close()


def test_a_cluster_with_a_dns_endpoint_is_reached_through_it_without_the_cluster_ca(gke, dns_front_end, monkeypatch):
    """Vertex AI reaches a private cluster through its DNS-based endpoint: TLS verified against the default
    roots (certifi; here a test root stands for them), not against the cluster CA, which does not sign it."""
    gke.set_endpoints(dns=dns_front_end["host"], allow_external_traffic=True, private_ip="10.128.0.2")
    cluster_ca = dns_front_end["cluster_ca"].read_bytes()
    gke.cluster_info["masterAuth"] = {"clusterCaCertificate": base64.b64encode(cluster_ca).decode()}
    monkeypatch.setattr(k8s_rest.certifi, "where", lambda: str(dns_front_end["public_ca"]))
    credentials = Credentials(token="ya29.dns-token")
    api = access.api_client(CLUSTER, container=gke.client(), credentials=credentials)
    assert api.configuration.host == f"https://{dns_front_end['host']}"
    assert api.configuration.ssl_ca_cert is None  # the default roots, no pinned cluster CA
    assert k8s.VersionApi(api).get_code().git_version == "v1.33.2-gke.1"
    assert dns_front_end["seen"] == ["Bearer ya29.dns-token"]
    assert gke.calls("GET") == [(PATH, None)]
    # Why no CA is pinned: verified against the cluster CA, the front end's certificate is refused.
    pinned = k8s.Configuration()
    pinned.host, pinned.ssl_ca_cert = api.configuration.host, str(dns_front_end["cluster_ca"])
    pinned.retries = 0
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
        k8s.VersionApi(k8s.ApiClient(pinned)).get_code()


def test_the_dns_endpoint_is_preferred_to_a_public_ip_endpoint(gke):
    gke.set_endpoints(dns=DNS, allow_external_traffic=True, public_ip="34.118.0.10")
    api = access.api_client(CLUSTER, container=gke.client(), credentials=Credentials(token="t"))
    assert api.configuration.host == f"https://{DNS}"
    assert api.configuration.ssl_ca_cert is None


def test_a_public_ip_endpoint_is_used_with_the_cluster_ca_when_the_dns_endpoint_refuses_external_traffic(gke):
    gke.set_endpoints(dns=DNS, allow_external_traffic=False, public_ip="34.118.0.10", private_ip="10.128.0.2")
    api = access.api_client(CLUSTER, container=gke.client(), credentials=Credentials(token="t"))
    assert api.configuration.host == "https://34.118.0.10"
    assert Path(api.configuration.ssl_ca_cert).read_bytes() == base64.b64decode(
        gke.cluster_info["masterAuth"]["clusterCaCertificate"]
    )


def test_a_public_ip_endpoint_behind_authorized_networks_is_refused_with_the_dns_endpoint_fix(gke):
    """Authorized networks admit only their CIDR blocks to the IP endpoints; Vertex AI's workers have none of those
    addresses, so a run would time out on its first call: refused with the fix (the DNS-based endpoint)."""
    gke.set_endpoints(dns=DNS, allow_external_traffic=False, public_ip="34.118.0.10",
                      authorized_networks=["203.0.113.0/24"])  # fmt: skip
    with pytest.raises(access.ClusterAccessError) as caught:
        access.api_client(CLUSTER, container=gke.client(), credentials=Credentials(token="t"))
    message = str(caught.value)
    assert "admits only its authorized networks (203.0.113.0/24)" in message
    assert "gcloud container clusters update tpu-cluster --location us-east5 --enable-dns-access" in message


@pytest.mark.parametrize(
    ("dns_external", "networks", "gcp_public", "host"),
    [
        (True, ["203.0.113.0/24"], False, f"https://{DNS}"),  # the DNS-based endpoint, which networks do not gate
        (False, ["0.0.0.0/0"], False, "https://34.118.0.10"),
        (False, ["203.0.113.0/24"], True, "https://34.118.0.10"),  # Google Cloud's public addresses admitted
    ],
    ids=["dns-endpoint", "any-address", "google-cloud-addresses"],
)  # fmt: skip
def test_authorized_networks_that_admit_the_caller_keep_an_endpoint(gke, dns_external, networks, gcp_public, host):
    gke.set_endpoints(dns=DNS, allow_external_traffic=dns_external, public_ip="34.118.0.10",
                      authorized_networks=networks, gcp_public_cidrs=gcp_public)  # fmt: skip
    api = access.api_client(CLUSTER, container=gke.client(), credentials=Credentials(token="t"))
    assert api.configuration.host == host


@pytest.mark.parametrize(
    ("endpoints", "reason"),
    [
        ({"dns": DNS, "private_ip": "10.128.0.2"},
         rf"only a private IP endpoint \(10.128.0.2\) and its DNS-based endpoint {DNS} does not allow external"),
        ({"dns": DNS}, "has no IP endpoint and its DNS-based endpoint .* does not allow external traffic"),
    ],
    ids=["private-ip-only", "dns-internal-only"],
)  # fmt: skip
def test_a_cluster_vertex_cannot_reach_is_refused_with_the_fix(gke, endpoints, reason):
    gke.set_endpoints(**endpoints)
    with pytest.raises(access.ClusterAccessError) as caught:
        access.api_client(CLUSTER, container=gke.client(), credentials=Credentials(token="t"))
    message = str(caught.value)
    assert re.search(reason, message), message
    assert "a caller outside the cluster's VPC, as Vertex AI Pipelines' components are, cannot reach" in message
    assert "gcloud container clusters update tpu-cluster --location us-east5 --enable-dns-access" in message
    assert "container.clusters.connect" in message
    assert "cluster.access kubeconfig" in message and "--internal-ip" in message
