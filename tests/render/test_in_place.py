"""In-place restart in the rendered TPU JobSet and RBAC (multislice/render/in_place.py), against JobSet v0.12.0's
webhook rules (pkg/webhooks/jobset_webhook.go) and its example (site/static/examples/in-place-restart/)."""

from __future__ import annotations

import pytest

from multislice import config, names
from multislice.plan import make_plan
from multislice.render import in_place, jobset, kueue, rbac, schema
from multislice.render.manifests import object_problems


def _plan(**overrides):
    return make_plan(
        config.load_profile("gke-v6e-16x2", {"run_name": "r1", "output_dir": "gs://bucket/runs", **overrides})
    )


def _job(obj):
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]


def test_tpu_jobset_renders_in_place_restart_as_the_webhook_requires_and_validates():
    plan = _plan()
    for stage in plan.stages:  # both production stages
        obj = jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id="run-7")
        schema.validate(obj)  # the JobSet v0.12.0 CRD
        assert obj["spec"]["failurePolicy"]["restartStrategy"] == "InPlaceRestart"
        job = _job(obj)
        assert job["backoffLimit"] == 2147483647 and job["podReplacementPolicy"] == "Failed"
        assert job["completions"] == job["parallelism"]
        pod = job["template"]["spec"]
        [agent] = pod["initContainers"]
        assert agent["name"] == in_place.AGENT_CONTAINER and agent["restartPolicy"] == "Always"
        assert agent["image"] == plan.spec.images.in_place_restart_agent
        assert agent["restartPolicyRules"] == [
            {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0]}}
        ]
        assert agent["startupProbe"]["httpGet"] == {"path": "/barrier-is-down", "port": 8081}
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]}
        assert env == {"JOBSET_NAME": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']",
                       "POD_NAME": "metadata.name"}  # fmt: skip
        assert "resources" not in agent  # no requests: Kueue's pod sets stay TPU chips only


def test_fatal_exit_codes_match_no_in_place_rule_and_still_fail_the_jobset():
    obj = jobset.render_jobset(_plan(), _plan().stages[0], hardware="tpu", pipeline_run_id="r")
    job = _job(obj)
    [trainer] = job["template"]["spec"]["containers"]
    assert trainer["restartPolicy"] == "Never"
    [rule] = trainer["restartPolicyRules"]
    assert rule["action"] == "RestartAllContainers" and rule["exitCodes"]["operator"] == "In"
    restartable = set(rule["exitCodes"]["values"])
    assert restartable == set(jobset.RESTARTABLE_EXIT_CODES) and len(restartable) <= 255  # the API's bound
    assert 1 not in restartable and 0 not in restartable and {42, 137, 143} <= restartable
    # a fatal exit leaves the pod failed: the Job's podFailurePolicy fails the Job, the JobSet's rule the JobSet
    [fail_job] = job["podFailurePolicy"]["rules"]
    assert fail_job["action"] == "FailJob" and fail_job["onExitCodes"]["operator"] == "NotIn"
    assert set(fail_job["onExitCodes"]["values"]) == restartable
    rules = obj["spec"]["failurePolicy"]["rules"]
    assert rules[0] == {"name": "failJobSetOnNonRetriableExit", "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"]}  # fmt: skip


def test_only_the_agent_mounts_the_service_account_token():
    plan = _plan()
    pod = _job(jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="r"))["template"]["spec"]
    [agent], [trainer] = pod["initContainers"], pod["containers"]
    assert {"name": in_place.TOKEN_VOLUME, "mountPath": in_place.TOKEN_DIR, "readOnly": True} in agent["volumeMounts"]
    assert all(m["name"] != in_place.TOKEN_VOLUME for m in trainer["volumeMounts"])
    assert "automountServiceAccountToken" not in pod  # the trainer ServiceAccount's false applies to the pod
    [volume] = [v for v in pod["volumes"] if v["name"] == in_place.TOKEN_VOLUME]
    sources = [next(iter(source)) for source in volume["projected"]["sources"]]
    assert sources == ["serviceAccountToken", "configMap", "downwardAPI"]


@pytest.mark.parametrize("hardware", ["cpu"])
def test_cpu_jobsets_and_recreate_keep_the_recreate_shape(hardware):
    for plan, hw in ((_plan(), hardware), (_plan(restart_strategy="recreate"), "tpu")):
        obj = jobset.render_jobset(plan, plan.stages[0], hardware=hw, pipeline_run_id="r")
        job = _job(obj)
        assert obj["spec"]["failurePolicy"]["restartStrategy"] == "Recreate" and job["backoffLimit"] == 0
        assert "podReplacementPolicy" not in job and "initContainers" not in job["template"]["spec"]
        assert "restartPolicyRules" not in job["template"]["spec"]["containers"][0]


def test_kueue_quota_is_the_same_with_the_agent():
    in_place_plan, recreate_plan = _plan(), _plan(restart_strategy="recreate")
    assert kueue.resource_groups(in_place_plan) == kueue.resource_groups(recreate_plan)
    pod = _job(jobset.render_jobset(in_place_plan, in_place_plan.stages[0], hardware="tpu", pipeline_run_id="r"))
    assert {k: str(v) for k, v in kueue.pod_requests(pod["template"]["spec"]).items()} == {"google.com/tpu": "4"}


def test_rbac_lets_the_trainer_account_patch_pods_and_watch_jobsets_and_the_policy_limits_it():
    plan = _plan()
    objects = rbac.render_rbac_objects(plan)
    account = plan.spec.service_accounts.trainer
    [role] = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == f"{account}-in-place-restart"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "watch"]},
    ]
    [binding] = [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "default"}]
    [policy] = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    [vap_binding] = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert vap_binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    [condition] = policy["spec"]["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username == 'system:serviceaccount:default:{account}'"
    assert in_place.ATTEMPT_ANNOTATION in policy["spec"]["validations"][0]["expression"]
    assert all(object_problems(o) == [] for o in objects)
    recreate = rbac.render_rbac_objects(_plan(restart_strategy="recreate"))
    assert not [o for o in recreate if "in-place-restart" in o["metadata"]["name"]]


def test_a_policy_with_an_unknown_action_is_refused():
    [policy, binding] = in_place.admission_policy("default", "trainer", "p")
    binding["spec"]["validationActions"] = ["Block"]
    assert rbac.problems(binding) == ["spec.validationActions: one or more of Deny, Warn, Audit"]
    assert rbac.problems(policy) == []


def test_the_attempt_annotation_is_jobsets_key():
    assert in_place.ATTEMPT_ANNOTATION.startswith(names.JOBSET_NAME_KEY.split("/")[0])
