# ruff: noqa: F811  (the GKE scenarios' pytest fixtures are imported, and named again as parameters)
"""Dynamic Workload Scheduler on GKE: flex-start and queued provisioning, rendered and over the emulated API.

Rendering: with ``node_pools.queued_provisioning`` the Kueue objects gain a ProvisioningRequestConfig and an
AdmissionCheck that the ClusterQueue names (as xpk renders them), valid against the Kueue v0.19.2 CRDs, and
the RBAC grants applying exactly those; without it nothing changes. Waits: flex-start stretches admit, launch
and the Unschedulable grace to ``node_pools.max_wait_for_capacity_seconds`` (default seven days).

Scenarios (the harness of tests/backends/gke/test_steps.py: kmock's emulator over HTTP, enforced RBAC, scripted
controllers that wait for the step to report what they changed, never sleeping).
"""

from __future__ import annotations

import re

import pytest

from multislice import config
from multislice.backends.base import AdmissionBlocked, LaunchFailed
from multislice.backends.gke import GkeBackend, prerequisites
from multislice.config.models import FLEX_START_MAX_WAIT_SECONDS
from multislice.errors import ConfigError
from multislice.plan import make_plan
from multislice.render import kueue, rbac, schema
from multislice.steps import admit, launch, provision
from multislice.timings import DEFAULTS, timings_for, with_capacity_wait
from tests.backends.gke.harness import POOLS, RUN_ID, Background, stage_of
from tests.kube_cluster import FAST
from tests.kube_rbac import service_account_user

CHECK = "multislice-cluster-queue-dws"
CONFIG = "multislice-cluster-queue-dws-config"
BASE = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True}
QUEUED = {**BASE, "node_pools.provisioning": "flex-start", "node_pools.queued_provisioning": True}

# The GKE scenarios' fixtures this module's tests all take (tests/backends/gke/conftest.py).
pytestmark = pytest.mark.usefixtures("crd_schemas", "node_pools", "run_storage")


def spec_of(overrides):
    return config.load_profile("gke-v6e-16x2-seed", overrides)


@pytest.fixture
def plan():
    return make_plan(spec_of({**QUEUED, "node_pools.max_wait_for_capacity_seconds": 60}))


@pytest.fixture(autouse=True)
def least_privilege(served, plan):
    """The steps act as the pipeline's ServiceAccount under the RBAC rendered for the queued-provisioning plan."""
    accounts = plan.spec.service_accounts
    served.as_user(service_account_user(plan.spec.namespace, accounts.pipeline), rbac.render_rbac_objects(plan))
    return served.cluster.authorizer


# -- rendering ---------------------------------------------------------------------------------------------------


def test_queued_provisioning_renders_a_provisioning_request_config_and_admission_check_on_the_cluster_queue():
    objects = provision.kueue_objects(make_plan(spec_of(QUEUED)))  # validated against the Kueue v0.19.2 CRDs
    by_kind = {obj["kind"]: obj for obj in objects}
    assert [obj["kind"] for obj in objects] == [  # the CPU flavor: a run picking launcher=ray needs it
        "ResourceFlavor", "ResourceFlavor", "ProvisioningRequestConfig", "AdmissionCheck", "ClusterQueue",
        "WorkloadPriorityClass", "LocalQueue",
    ]  # fmt: skip
    prc = by_kind["ProvisioningRequestConfig"]
    assert prc["apiVersion"] == "kueue.x-k8s.io/v1beta2"  # the storage version of Kueue v0.19.2's CRD
    assert prc["metadata"]["name"] == CONFIG
    assert prc["spec"]["provisioningClassName"] == "queued-provisioning.gke.io"
    assert prc["spec"]["managedResources"] == ["google.com/tpu"]
    assert prc["spec"]["podSetUpdates"]["nodeSelector"] == [
        {"key": "autoscaling.gke.io/provisioning-request", "valueFromProvisioningClassDetail": "ResizeRequestName"}
    ]
    check = by_kind["AdmissionCheck"]
    assert check["metadata"]["name"] == CHECK
    assert check["spec"] == {
        "controllerName": "kueue.x-k8s.io/provisioning-request",
        "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig", "name": CONFIG},
    }
    assert by_kind["ClusterQueue"]["spec"]["admissionChecksStrategy"] == {"admissionChecks": [{"name": CHECK}]}


def test_a_profile_without_queued_provisioning_renders_no_admission_check():
    for overrides in (BASE, {**BASE, "node_pools.provisioning": "flex-start"}):
        plan = make_plan(spec_of(overrides))
        objects = provision.kueue_objects(plan)
        assert [obj["kind"] for obj in objects] == [
            "ResourceFlavor", "ResourceFlavor", "ClusterQueue", "WorkloadPriorityClass", "LocalQueue",
        ]  # fmt: skip
        assert "admissionChecksStrategy" not in objects[2]["spec"]
        resources = {r for obj in rbac.render_rbac_objects(plan) for rule in obj.get("rules", [])
                     for r in rule["resources"]}  # fmt: skip
        assert not resources & {"admissionchecks", "provisioningrequestconfigs"}


def test_the_admission_check_kind_pattern_of_the_crd_is_enforced():
    # Kueue's CRD gives parameters.kind the RE2 pattern ^(?i)[a-z]([-a-z0-9]*[a-z0-9])?$: a bad kind is refused.
    [_, check] = kueue.render_queued_provisioning("q", {})
    check["spec"]["parameters"]["kind"] = "Provisioning_Request_Config"
    with pytest.raises(schema.ManifestInvalid, match="parameters.kind"):
        schema.validate(check)


def test_rbac_grants_applying_the_dws_objects_by_name_only_with_queued_provisioning():
    plan = make_plan(spec_of(QUEUED))
    rules = [rule for obj in rbac.render_rbac_objects(plan) for rule in obj.get("rules", [])]
    granted = {rule["resources"][0]: rule for rule in rules if rule["apiGroups"] == ["kueue.x-k8s.io"]}
    assert granted["provisioningrequestconfigs"]["resourceNames"] == [CONFIG]
    assert granted["admissionchecks"]["resourceNames"] == [CHECK]
    assert granted["admissionchecks"]["verbs"] == ["get", "patch", "create"]


# -- waits -------------------------------------------------------------------------------------------------------


def test_flex_start_waits_as_long_as_the_profile_says_default_seven_days():
    standard = timings_for(spec_of(BASE))
    assert standard == DEFAULTS["gke"]  # unchanged without flex-start
    flex = timings_for(spec_of({**BASE, "node_pools.provisioning": "flex-start"}))
    assert FLEX_START_MAX_WAIT_SECONDS == 7 * 24 * 3600
    assert flex.launch_timeout == flex.unschedulable_grace == flex.admit_timeout == FLEX_START_MAX_WAIT_SECONDS
    short = timings_for(spec_of({**QUEUED, "node_pools.max_wait_for_capacity_seconds": 7200}))
    assert (short.launch_timeout, short.unschedulable_grace) == (7200, 7200)
    assert short.admit_timeout == DEFAULTS["gke"].admit_timeout  # 6 h is already longer than 2 h
    assert timings_for(spec_of({**BASE, "node_pools.provisioning": "flex-start"}), "local") == DEFAULTS["local"]


def test_a_capacity_wait_without_flex_start_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"max_wait_for_capacity_seconds applies to provisioning: flex-start"):
        spec_of({**BASE, "node_pools.max_wait_for_capacity_seconds": 60})


# -- scenarios ---------------------------------------------------------------------------------------------------


def test_provision_applies_the_dws_objects_under_enforced_rbac(served, play, plan, least_privilege):
    report = provision.run(plan, backend=GkeBackend(served.kube()))
    assert report.kueue_objects == [
        "ResourceFlavor/v6e-4x4", "ResourceFlavor/multislice-cpu", f"ProvisioningRequestConfig/{CONFIG}",
        f"AdmissionCheck/{CHECK}", "ClusterQueue/multislice-cluster-queue", "WorkloadPriorityClass/default-priority",
        "LocalQueue/multislice-queue",
    ]  # fmt: skip
    get = play.custom.get_cluster_custom_object
    assert get("kueue.x-k8s.io", "v1beta2", "admissionchecks", CHECK)["spec"]["parameters"]["name"] == CONFIG
    assert get("kueue.x-k8s.io", "v1beta2", "provisioningrequestconfigs", CONFIG)["spec"]["managedResources"] == [
        "google.com/tpu"
    ]
    queue = get("kueue.x-k8s.io", "v1beta2", "clusterqueues", "multislice-cluster-queue")
    assert queue["spec"]["admissionChecksStrategy"]["admissionChecks"] == [{"name": CHECK}]
    assert least_privilege.denied == []


def test_provision_without_the_dws_rules_is_refused_before_any_node_pool(served, play, plan, node_pools):
    # The RBAC of a plan without queued provisioning does not let the pipeline apply the AdmissionCheck: provision's
    # SelfSubjectAccessReviews find it before a node pool is asked for, and no request is tried.
    plain = make_plan(plan.spec.model_copy(update={"node_pools": config.NodePoolSpec()}))
    served.as_user(served.user, rbac.render_rbac_objects(plain))
    with pytest.raises(prerequisites.AccessMissing) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert refused.value.message.endswith(
        f'Missing: get, patch, create provisioningrequestconfigs.kueue.x-k8s.io "{CONFIG}" cluster-wide; '
        f'get, patch, create admissionchecks.kueue.x-k8s.io "{CHECK}" cluster-wide'
    )
    assert node_pools == [] and served.cluster.authorizer.denied == []


def test_admit_shows_the_provisioning_request_state_then_is_admitted(served, play, plan, told, capsys):
    js = stage_of(plan).jobset
    queued = "Provisioning Request was successfully queued."

    def kueue():
        play.kueue_queues(js, "waiting")
        play.kueue_checks(js, CHECK, "Pending", queued)
        told.wait_for(
            r"waiting for admission \(\d+ s\): quota reserved, waiting for admission checks: "
            + re.escape(f"AdmissionCheck {CHECK} Pending: {queued}")
        )
        play.kueue_checks(js, CHECK, "Ready", "Provisioning Request was successfully provisioned.")
        play.kueue_admits(js)

    with Background(kueue, told):
        report = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(served.kube()))
    assert report.admitted and report.cluster_queue == "multislice-cluster-queue"
    assert f"quota reserved, waiting for admission checks: AdmissionCheck {CHECK} Pending: {queued}" in (
        capsys.readouterr().out
    )


def test_a_rejected_provisioning_check_fails_admit_with_the_cause_and_a_fix(served, play, plan):
    js = stage_of(plan).jobset
    failed = "Cannot provision TPUs: the zone does not have enough resources available to fulfill the request"

    def kueue():
        play.jobset(js)
        play.kueue_queues(js, "waiting")
        play.kueue_checks(js, CHECK, "Rejected", failed)

    with Background(kueue), pytest.raises(AdmissionBlocked) as refused:
        admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(served.kube()))
    assert f"AdmissionCheck {CHECK} Rejected: {failed}" in refused.value.message
    assert "was deleted" in refused.value.message
    assert "flex-start TPU quota" in refused.value.fix and "node_pools.zone" in refused.value.fix


def admitted_with_unschedulable_pods(play, plan, kube, message):
    """Admit stage 1 through a scripted Kueue, then give it 2 slices of pods the scheduler left Unschedulable."""
    js = stage_of(plan).jobset

    def kueue():
        play.kueue_queues(js, "waiting")
        play.kueue_admits(js)

    with Background(kueue):
        admitted = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                  "message": message}]}  # fmt: skip
    return admitted, play.pods(js, 2, plan.slice.hosts, status=status)


def test_flex_start_pods_unschedulable_past_the_old_grace_but_within_the_wait_launch(served, play, plan, told):
    timings = with_capacity_wait(FAST, plan.spec)  # FAST's 0.5 s grace -> the profile's 60 s
    assert timings.unschedulable_grace == 60 > FAST.unschedulable_grace
    kube = served.kube(timings=timings)
    message = "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."
    admitted, pods = admitted_with_unschedulable_pods(play, plan, kube, message)

    def capacity_arrives():
        # Launch has seen the pods Unschedulable for at least 1 s (rounded), past FAST's 0.5 s grace.
        told.wait_for(r"Unschedulable for [1-9]\d* s, flex-start: waiting up to 60 s for capacity")
        for i, pod in enumerate(pods):
            play.pod_scheduled(pod, f"gke-{POOLS[i // plan.slice.hosts]}-{i % plan.slice.hosts}")

    with Background(capacity_arrives, told):
        launched = launch.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert launched.pods == len(pods) and launched.node_pools == POOLS


def test_flex_start_pods_unschedulable_past_the_wait_fail_launch_naming_the_field(served, play, told):
    plan = make_plan(spec_of({**QUEUED, "node_pools.max_wait_for_capacity_seconds": 1}))
    kube = served.kube(timings=with_capacity_wait(FAST, plan.spec))
    assert kube.timings.unschedulable_grace == 1
    admitted, _ = admitted_with_unschedulable_pods(play, plan, kube, "0/8 nodes are available")
    with pytest.raises(LaunchFailed) as failure:
        launch.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert "Unschedulable for" in failure.value.message
    assert "raise node_pools.max_wait_for_capacity_seconds" in failure.value.fix


def test_render_writes_the_dws_objects_with_the_other_kueue_objects():
    from multislice.backends import manifests

    rendered = manifests.render_all(make_plan(spec_of(QUEUED)), RUN_ID)
    assert rendered[f"kueue-provisioningrequestconfig-{CONFIG}.yaml"]["kind"] == "ProvisioningRequestConfig"
    assert rendered[f"kueue-admissioncheck-{CHECK}.yaml"]["spec"]["parameters"]["name"] == CONFIG
    plain = manifests.render_all(make_plan(spec_of(BASE)), RUN_ID)
    assert not [name for name in plain if "admissioncheck" in name or "provisioningrequestconfig" in name]
