"""JobSet expansion into local pods: names, controller metadata, downward API, $(VAR), DNS."""

import pytest

from multislice import config, plan
from multislice.backends.local.pods import UnsupportedManifest, expand_jobset, expand_vars
from multislice.render import jobset


@pytest.fixture
def cpu_jobset():
    p = plan.make_plan(config.load_profile("local", {"run_name": "demo", "output_dir": "/o"}))
    return jobset.render_jobset(p, p.stages[1], hardware="cpu", pipeline_run_id="42")


def test_one_pod_per_host_of_each_slice(cpu_jobset):
    pods = expand_jobset(cpu_jobset)
    assert [p.hostname for p in pods] == [
        "demo-tiny-70b-recipe-slice-0-0",
        "demo-tiny-70b-recipe-slice-0-1",
        "demo-tiny-70b-recipe-slice-1-0",
        "demo-tiny-70b-recipe-slice-1-1",
    ]
    assert [p.job for p in pods][::2] == ["demo-tiny-70b-recipe-slice-0", "demo-tiny-70b-recipe-slice-1"]


def test_env_is_what_maxtext_cpu_path_reads(cpu_jobset):
    pods = expand_jobset(cpu_jobset, restart_attempt=3)
    pid = [int(p.env["JOB_INDEX"]) * int(p.env["PROCESSES_IN_JOB"]) + int(p.env["JOB_COMPLETION_INDEX"]) for p in pods]
    assert pid == [0, 1, 2, 3]
    assert {p.env["JAX_PROCESS_COUNT"] for p in pods} == {"4"}
    assert {p.env["JAX_COORDINATOR_ADDRESS"] for p in pods} == {"127.0.0.1"}  # pod 0 of slice 0, resolved locally
    assert pods[0].env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert pods[3].annotations["jobset.sigs.k8s.io/restart-attempt"] == "3"
    assert pods[3].labels["pipeline/runid"] == "42"


def test_coordinator_address_is_the_pod_dns_name_before_local_resolution(cpu_jobset):
    cpu_jobset["spec"]["network"]["subdomain"] = "elsewhere"  # no longer one of this JobSet's names
    env = expand_jobset(cpu_jobset)[0].env
    assert env["JAX_COORDINATOR_ADDRESS"] == "demo-tiny-70b-recipe-slice-0-0.demo-tiny-70b-recipe"


def test_var_expansion_follows_kubernetes_rules():
    env = {"A": "x", "B": "y"}
    assert expand_vars("$(A)-$(B)-$(C)", env) == "x-y-$(C)"
    assert expand_vars("$$(A)", env) == "$(A)"


def test_unsupported_field_ref_is_named(cpu_jobset):
    container = cpu_jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    with pytest.raises(UnsupportedManifest, match="env NODE"):
        expand_jobset(cpu_jobset)
