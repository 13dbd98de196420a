"""TPU node pools through google-cloud-container's real REST client, against a local fake of the GKE API."""

from __future__ import annotations

import pytest
from google.cloud import container_v1

from multislice import config
from multislice.backends.gke import nodepool
from multislice.plan import make_plan
from tests.gke_fake import FakeGke

PARENT = "projects/my-project/locations/us-east5/clusters/tpu-cluster"
POOLS_PATH = f"/v1/{PARENT}/nodePools"
COMPACT = int(container_v1.NodePool.PlacementPolicy.Type.COMPACT)
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]


def make(**overrides):
    """The gke-v6e-16x2-seed plan (2 x v6e-16: 4 hosts of ct6e-standard-4t, topology 4x4) on the fake's cluster."""
    base = {"cluster.project": "my-project", "cluster.location": "us-east5", "cluster.name": "tpu-cluster"}
    return make_plan(config.load_profile("gke-v6e-16x2-seed", {**base, **overrides}))


@pytest.fixture
def gke():
    fake = FakeGke().start()
    yield fake
    fake.stop()


def ensure(plan, gke, messages=None):
    return nodepool.ensure_node_pools(
        plan, gke.client(), on_progress=(messages.append if messages is not None else lambda _: None), poll_seconds=0.01
    )


def test_creates_one_pool_per_slice_and_waits_on_each_operation(gke):
    messages: list[str] = []
    gke.polls_until_done = 3
    report = ensure(make(), gke, messages)

    posts = gke.calls("POST")
    assert [path for path, _ in posts] == [POOLS_PATH, POOLS_PATH]
    assert posts[0][1] == {
        "nodePool": {
            "name": "tpu-v6e-4x4-0",
            "config": {"machineType": "ct6e-standard-4t", "oauthScopes": SCOPES},
            "initialNodeCount": 4,
            "locations": ["us-east5-b"],
            "placementPolicy": {"type": COMPACT, "tpuTopology": "4x4"},
        }
    }
    assert posts[1][1]["nodePool"]["name"] == "tpu-v6e-4x4-1"
    # Each operation was polled until DONE (3 polls each), through the location's operations URL.
    polls = [path for path, _ in gke.calls("GET") if "/operations/" in path]
    assert polls == [f"/v1/projects/my-project/locations/us-east5/operations/operation-{i}" for i in (1, 1, 1, 2, 2, 2)]
    assert report["created"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"] and report["adopted"] == []
    assert report["cluster"] == PARENT
    [first, second] = report["node_pools"]
    assert first == {
        "name": "tpu-v6e-4x4-0",
        "action": "created",
        "machine_type": "ct6e-standard-4t",
        "topology": "4x4",
        "node_count": 4,
        "provisioning": "standard",
        "reservation": None,
        "zone": "us-east5-b",
        "additional_node_networks": [],
        "operation": "operation-1",
        "seconds": first["seconds"],
        "status": "RUNNING",
    }
    assert second["status"] == "RUNNING" and gke.pools["tpu-v6e-4x4-1"]["status"] == "RUNNING"
    assert any("tpu-v6e-4x4-0: CREATE_NODE_POOL RUNNING" in m for m in messages)
    assert any("tpu-v6e-4x4-1: CREATE_NODE_POOL DONE" in m for m in messages)
    assert messages[-1].startswith("node pool tpu-v6e-4x4-1: created in")


def test_cluster_busy_with_an_operation_waits_then_creates(gke):
    gke.max_running_operations = 1
    messages: list[str] = []
    report = ensure(make(), gke, messages)
    assert report["created"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]
    # The second create was refused once, sent again after operation-1 finished, and succeeded.
    creates = [(m, p) for m, p, _ in gke.requests if m == "POST" or "/operations/" in p]
    assert creates == [
        ("POST", POOLS_PATH),
        ("POST", POOLS_PATH),
        ("GET", "/v1/projects/my-project/locations/us-east5/operations/operation-1"),
        ("GET", "/v1/projects/my-project/locations/us-east5/operations/operation-1"),
        ("POST", POOLS_PATH),
        ("GET", "/v1/projects/my-project/locations/us-east5/operations/operation-2"),
        ("GET", "/v1/projects/my-project/locations/us-east5/operations/operation-2"),
    ]
    assert "node pool tpu-v6e-4x4-1: GKE is busy with another operation on the cluster; waiting for tpu-v6e-4x4-0" in (
        "\n".join(messages)
    )


def test_adopts_matching_pools_and_creates_nothing(gke):
    plan = make()
    shape = nodepool.PoolShape.of(plan)
    for name in nodepool.pool_names(plan):
        gke.add_pool(nodepool.node_pool_body(name, shape))
    messages: list[str] = []
    report = ensure(plan, gke, messages)
    assert gke.calls("POST") == []
    assert [p["action"] for p in report["node_pools"]] == ["adopted", "adopted"]
    assert report["adopted"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"] and report["created"] == []
    assert "tpu-v6e-4x4-0: exists with the right shape (RUNNING), adopted" in "\n".join(messages)


def test_adopts_one_and_creates_the_other(gke):
    plan = make()
    gke.add_pool(nodepool.node_pool_body("tpu-v6e-4x4-0", nodepool.PoolShape.of(plan)))
    report = ensure(plan, gke)
    assert [(p["name"], p["action"]) for p in report["node_pools"]] == [
        ("tpu-v6e-4x4-0", "adopted"),
        ("tpu-v6e-4x4-1", "created"),
    ]
    assert [body["nodePool"]["name"] for _, body in gke.calls("POST")] == ["tpu-v6e-4x4-1"]


def test_mismatched_pool_is_an_error_with_a_diff_and_nothing_is_created(gke):
    plan = make()
    wrong = container_v1.NodePool(
        name="tpu-v6e-4x4-1",
        config=container_v1.NodeConfig(machine_type="ct5lp-hightpu-4t", spot=True),
        initial_node_count=2,
        locations=["us-east5-b"],
        placement_policy=container_v1.NodePool.PlacementPolicy(
            type_=container_v1.NodePool.PlacementPolicy.Type.COMPACT, tpu_topology="2x4"
        ),
    )
    gke.add_pool(wrong)
    with pytest.raises(nodepool.NodePoolMismatch) as caught:
        ensure(plan, gke)
    assert gke.calls("POST") == []
    assert caught.value.diffs == {
        "tpu-v6e-4x4-1": [
            ("config.machineType", "ct6e-standard-4t", "ct5lp-hightpu-4t"),
            ("placementPolicy.tpuTopology", "4x4", "2x4"),
            ("nodes", 4, 2),
            ("config.spot", False, True),
            ("config.oauthScopes", SCOPES, []),  # a pool made without scopes cannot write gs://
        ]
    }
    message = str(caught.value)
    assert "nothing was created" in message
    assert "tpu-v6e-4x4-1.config.machineType: wanted 'ct6e-standard-4t', found 'ct5lp-hightpu-4t'" in message
    assert "node_pools.name_prefix" in message
    assert gke.pools["tpu-v6e-4x4-1"]["config"]["machineType"] == "ct5lp-hightpu-4t"  # untouched


def test_manage_false_checks_and_names_what_to_create(gke):
    plan = make(**{"node_pools.manage": False})
    gke.add_pool(nodepool.node_pool_body("tpu-v6e-4x4-0", nodepool.PoolShape.of(plan)))
    with pytest.raises(nodepool.NodePoolsMissing) as caught:
        ensure(plan, gke)
    assert gke.calls("POST") == []
    assert caught.value.missing == ["tpu-v6e-4x4-1"]
    message = str(caught.value)
    assert "1 of 2 node pool(s) are missing" in message
    assert (
        "gcloud container node-pools create tpu-v6e-4x4-1 --cluster=tpu-cluster --location=us-east5 "
        "--project=my-project --machine-type=ct6e-standard-4t --node-locations=us-east5-b --placement-type=COMPACT "
        "--tpu-topology=4x4 --scopes=https://www.googleapis.com/auth/cloud-platform --num-nodes=4" in message
    )
    gke.add_pool(nodepool.node_pool_body("tpu-v6e-4x4-1", nodepool.PoolShape.of(plan)))
    report = ensure(plan, gke)
    assert [p["action"] for p in report["node_pools"]] == ["checked", "checked"] and gke.calls("POST") == []


def test_spot_request_body(gke):
    ensure(make(**{"node_pools.provisioning": "spot"}), gke)
    body = gke.calls("POST")[0][1]["nodePool"]
    assert body["config"] == {"machineType": "ct6e-standard-4t", "spot": True, "oauthScopes": SCOPES}
    assert body["initialNodeCount"] == 4


def test_reservation_request_body(gke):
    ensure(make(**{"node_pools.provisioning": "reservation", "node_pools.reservation": "v6e-block"}), gke)
    body = gke.calls("POST")[0][1]["nodePool"]
    assert body["config"] == {
        "machineType": "ct6e-standard-4t",
        "oauthScopes": SCOPES,
        "reservationAffinity": {
            "consumeReservationType": int(container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION),
            "key": "compute.googleapis.com/reservation-name",
            "values": ["v6e-block"],
        },
    }
    # Adopting it again compares the reservation too.
    report = ensure(make(**{"node_pools.provisioning": "reservation", "node_pools.reservation": "v6e-block"}), gke)
    assert report["adopted"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]
    with pytest.raises(
        nodepool.NodePoolMismatch, match="config.reservationAffinity: wanted 'SPECIFIC_RESERVATION other"
    ):
        ensure(make(**{"node_pools.provisioning": "reservation", "node_pools.reservation": "other"}), gke)


def test_flex_start_with_queued_provisioning_request_body(gke):
    plan = make(**{"node_pools.provisioning": "flex-start", "node_pools.queued_provisioning": True})
    ensure(plan, gke)
    body = gke.calls("POST")[0][1]["nodePool"]
    assert body == {
        "name": "tpu-v6e-4x4-0",
        "config": {
            "machineType": "ct6e-standard-4t",
            "oauthScopes": SCOPES,
            "reservationAffinity": {
                "consumeReservationType": int(container_v1.ReservationAffinity.Type.NO_RESERVATION)
            },
            "flexStart": True,
        },
        "locations": ["us-east5-b"],
        "autoscaling": {
            "enabled": True,
            "maxNodeCount": 4,
            "locationPolicy": int(container_v1.NodePoolAutoscaling.LocationPolicy.ANY),
        },
        "management": {"autoUpgrade": True},
        "placementPolicy": {"type": COMPACT, "tpuTopology": "4x4"},
        "queuedProvisioning": {"enabled": True},
    }
    # The same plan adopts what it created (0 initial nodes, autoscaling to a whole slice).
    assert ensure(plan, gke)["adopted"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]


def test_additional_node_networks_request_body(gke):
    networks = [
        {"network": "dcn-net-1", "subnetwork": "dcn-sub-1"},
        {"network": "dcn-net-2", "subnetwork": "dcn-sub-2"},
    ]
    ensure(make(**{"node_pools.additional_node_networks": networks}), gke)
    body = gke.calls("POST")[0][1]["nodePool"]
    assert body["networkConfig"] == {"additionalNodeNetworkConfigs": networks}
    with pytest.raises(nodepool.NodePoolMismatch, match="additionalNodeNetworkConfigs"):
        ensure(make(), gke)


def test_operation_error_is_a_clear_failure(gke):
    gke.fail_operations["tpu-v6e-4x4-1"] = "GCE_STOCKOUT: no capacity for ct6e-standard-4t in us-east5-b"
    with pytest.raises(nodepool.NodePoolOperationFailed) as caught:
        ensure(make(), gke)
    message = str(caught.value)
    assert "creating node pool tpu-v6e-4x4-1 failed: GCE_STOCKOUT: no capacity" in message
    assert "operations/operation-2" in message
    assert "Pools created by this call stay: tpu-v6e-4x4-0, tpu-v6e-4x4-1" in message


def test_operation_deadline(gke):
    gke.polls_until_done = 10**6
    spec = make().spec  # 0.05 s is under a profile's 1 s minimum (MIN_TIMEOUT_SECONDS): set past validation
    plan = make_plan(spec.model_copy(update={"node_pools": spec.node_pools.model_copy(
        update={"operation_timeout_seconds": 0.05})}))  # fmt: skip
    with pytest.raises(nodepool.NodePoolOperationFailed, match="still RUNNING after 0 s"):
        ensure(plan, gke)


def test_refused_create_fails_at_once_with_the_api_message(gke):
    gke.reject_creates = (400, "INVALID_ARGUMENT", "Machine type ct6e-standard-4t is not available in us-east5-b.")
    with pytest.raises(nodepool.NodePoolError) as caught:
        ensure(make(), gke)
    assert str(caught.value) == (
        f"creating node pool tpu-v6e-4x4-0 on {PARENT} failed: "
        "Machine type ct6e-standard-4t is not available in us-east5-b."
    )
    assert len(gke.calls("POST")) == 1


def test_permission_denied_names_the_iam_permissions(gke):
    gke.reject_creates = (403, "PERMISSION_DENIED", "Required 'container.clusters.update' permission.")
    with pytest.raises(nodepool.NodePoolError, match="container.clusters.update .create them") as caught:
        ensure(make(), gke)
    assert "node_pools.manage: false" in str(caught.value)


def test_unknown_cluster_names_the_fields_to_check(gke):
    with pytest.raises(nodepool.NodePoolError, match="check cluster.project, cluster.location and cluster.name"):
        ensure(make(**{"cluster.name": "other-cluster"}), gke)
    assert gke.calls("POST") == []


def test_pool_in_error_state_is_not_adopted(gke):
    plan = make()
    gke.add_pool(nodepool.node_pool_body("tpu-v6e-4x4-0", nodepool.PoolShape.of(plan)), status="ERROR")
    with pytest.raises(nodepool.NodePoolError, match="tpu-v6e-4x4-0 is ERROR"):
        ensure(plan, gke)
    assert gke.calls("POST") == []


def test_incomplete_cluster_reference_fails_before_any_call():
    plan = make()
    spec = plan.spec.model_copy(update={"cluster": plan.spec.cluster.model_copy(update={"project": None})})
    with pytest.raises(config.ConfigError, match="cluster.project"):
        nodepool.ensure_node_pools(plan.model_copy(update={"spec": spec}), client=object())


def test_single_host_slices_get_no_placement_policy():
    plan = make(
        **{"tpu_type": "v6e-4", "stages.0.ici": {"fsdp": 4, "tensor": 1}, "stages.1.ici": {"tensor": 4, "fsdp": 1}}
    )
    body = nodepool.node_pool_body("p", nodepool.PoolShape.of(plan))
    assert "placement_policy" not in container_v1.NodePool.to_dict(body) or not body.placement_policy.tpu_topology
    assert body.initial_node_count == 1 and body.config.machine_type == "ct6e-standard-4t"


@pytest.mark.parametrize(
    ("overrides", "field", "fix"),
    [
        ({"node_pools.provisioning": "reservation"}, "node_pools", "set node_pools.reservation"),
        ({"node_pools.reservation": "r"}, "node_pools", "set node_pools.provisioning: reservation"),
        ({"node_pools.queued_provisioning": True}, "node_pools", "provisioning: flex-start"),
        ({"node_pools.zone": None}, "node_pools.zone", "set node_pools.zone"),
        ({"node_pools.zone": "europe-west4-a"}, "node_pools.zone", "use a zone of us-east5"),
        ({"node_pools.name_prefix": "TPU"}, "node_pools.name_prefix", "lower-case"),
        ({"cluster.location": None}, "cluster.location", "set cluster.location"),
        ({"node_pools.additional_node_networks": [{"network": "Bad Net", "subnetwork": "s"}]}, "network", "name"),
    ],
)
def test_node_pool_spec_errors_name_the_field_and_fix(overrides, field, fix):
    with pytest.raises(config.ConfigError) as caught:
        make(**overrides)
    [(where, message)] = caught.value.issues
    assert field in where and fix in message


def test_node_service_account_and_scopes_request_body_and_adoption(gke):
    account = "tpu-nodes@my-project.iam.gserviceaccount.com"
    storage = "https://www.googleapis.com/auth/devstorage.read_write"
    plan = make(**{"node_pools.service_account": account, "node_pools.oauth_scopes": [SCOPES[0], storage]})
    ensure(plan, gke)
    body = gke.calls("POST")[0][1]["nodePool"]
    assert body["config"] == {"machineType": "ct6e-standard-4t", "oauthScopes": [SCOPES[0], storage],
                              "serviceAccount": account}  # fmt: skip
    gcloud = nodepool.gcloud_create_args(plan, "tpu-v6e-4x4-0")
    assert f"--scopes={SCOPES[0]},{storage}" in gcloud and f"--service-account={account}" in gcloud
    # Adoption: more scopes than asked for are fine; another node service account is a mismatch.
    assert ensure(make(**{"node_pools.service_account": account}), gke)["adopted"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]
    with pytest.raises(nodepool.NodePoolMismatch, match="config.serviceAccount: wanted 'default'"):
        ensure(make(), gke)


def test_pool_without_storage_scopes_is_not_adopted(gke):
    plan = make()
    body = nodepool.node_pool_body("tpu-v6e-4x4-0", nodepool.PoolShape.of(plan))
    body.config.oauth_scopes = ["https://www.googleapis.com/auth/logging.write"]  # GKE's default without scopes
    gke.add_pool(body)
    with pytest.raises(nodepool.NodePoolMismatch, match="config.oauthScopes"):
        ensure(plan, gke)


def test_unspecified_placement_type_with_the_topology_is_adopted(gke):
    plan = make()
    for name in nodepool.pool_names(plan):
        body = nodepool.node_pool_body(name, nodepool.PoolShape.of(plan))
        body.placement_policy.type_ = container_v1.NodePool.PlacementPolicy.Type.TYPE_UNSPECIFIED  # --tpu-topology only
        gke.add_pool(body)
    assert ensure(plan, gke)["adopted"] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"node_pools.oauth_scopes": ["https://www.googleapis.com/auth/logging.write"]}, "include https://"),
        ({"node_pools.oauth_scopes": ["storage"]}, "is not an OAuth scope"),
        ({"node_pools.service_account": "nodes"}, "is not a Google service account email"),
        ({"service_accounts.tpu_workload_identity": True}, "GKE gives hostNetwork pods no Workload Identity"),
    ],
)
def test_identity_and_scope_errors_name_the_field(overrides, words):
    with pytest.raises(config.ConfigError) as refused:
        make(**overrides)
    assert words in str(refused.value)


def test_workload_identity_on_tpu_pods_drops_host_network_by_choice():
    from multislice.backends.gke import GkeBackend
    from multislice.render import jobset

    plan = make(**{"service_accounts.tpu_workload_identity": True, "service_accounts.tpu_host_network": False})
    rendered = jobset.render_jobset(plan, plan.stages[0], hardware=GkeBackend.hardware, pipeline_run_id="r")
    pod = rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and pod["serviceAccountName"] == "multislice-trainer"
    default = make()
    rendered = jobset.render_jobset(default, default.stages[0], hardware=GkeBackend.hardware, pipeline_run_id="r")
    assert rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["hostNetwork"] is True


def test_v6e_8_on_one_ct6e_standard_8t_vm_is_one_node_without_placement_policy():
    one_vm = {"tpu_type": "v6e-8", "machine_type": "ct6e-standard-8t", "stages.0.ici": {"fsdp": 8, "tensor": 1},
              "stages.1.ici": {"tensor": 8, "fsdp": 1}}  # fmt: skip
    body = nodepool.node_pool_body("p", nodepool.PoolShape.of(make(**one_vm)))
    assert body.initial_node_count == 1 and body.config.machine_type == "ct6e-standard-8t"
    assert not body.placement_policy.tpu_topology  # a single-host slice: no COMPACT placement
    # The default machine type of 2x4 is two ct6e-standard-4t hosts, placed as one slice.
    two_vms = nodepool.node_pool_body("p", nodepool.PoolShape.of(make(**{**one_vm, "machine_type": None})))
    assert two_vms.initial_node_count == 2 and two_vms.config.machine_type == "ct6e-standard-4t"
    assert two_vms.placement_policy.tpu_topology == "2x4"


def test_a_machine_type_the_topology_is_not_offered_on_is_refused_by_plan():
    with pytest.raises(config.ConfigError) as caught:
        make(machine_type="ct6e-standard-8t")  # the profile's v6e-16 (4x4) runs on ct6e-standard-4t only
    [(field, message)] = caught.value.issues
    assert field == "machine_type" and "cannot host v6e-16" in message and "ct6e-standard-8t hosts v6e-8" in message


@pytest.mark.parametrize("enabled", [True, False])
def test_ray_operator_enabled_reads_the_clusters_addons_config(gke, enabled):
    gke.ray_operator = enabled
    assert nodepool.ray_operator_enabled(make(), gke.client()) is enabled
    assert [path for path, _ in gke.calls("GET")] == [f"/v1/{PARENT}"]


def test_ray_operator_enabled_names_the_cluster_when_the_gke_api_refuses(gke):
    with pytest.raises(nodepool.NodePoolError, match=r"reading the cluster \(its Ray Operator add-on\) on "
                       r"projects/my-project/locations/us-east5/clusters/other.*check cluster.project"):  # fmt: skip
        nodepool.ray_operator_enabled(make(**{"cluster.name": "other"}), gke.client())
