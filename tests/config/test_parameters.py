"""One compiled YAML, any cluster: the deployment's values are run parameters that reach the steps.

Compiled once for gke-v6e-16x2-seed and submitted twice through the real ``kfp.Client`` (to the KFP
fake, tests/fakes.py) with two clusters as run parameters; each run's plan task is then
executed as the KFP driver would feed it (inputs resolved from the uploaded IR and the run's
parameters), and provision's GKE node-pool calls (google-cloud-container, REST, against
tests/gke_fake.py, one fake per cluster) go to the cluster that run named.
"""

from __future__ import annotations

import inspect
import types
import typing
import warnings

import pytest

import multislice
from components import plan as plan_component
from multislice import cancel, release
from multislice.backends.base import Backend
from multislice.backends.gke import nodepool
from multislice.delivery import submission
from multislice.plan import Plan
from multislice.steps import plan as run_plan
from tests import deployment
from tests.fakes import FakeServer
from tests.gke_fake import FakeGke

warnings.filterwarnings("ignore", category=FutureWarning)

CLUSTERS = [
    {"cluster_project": "team-a-project", "cluster_location": "us-east5", "cluster_name": "tpu-a",
     "zone": "us-east5-b", "cluster_access": "in-cluster", "namespace": "team-a"},
    {"cluster_project": "team-b-project", "cluster_location": "us-central2", "cluster_name": "tpu-b",
     "zone": "us-central2-b", "cluster_access": "gke", "namespace": "team-b"},
]  # fmt: skip


def task_inputs(pipeline_spec: dict, task: str, run: dict) -> dict:
    """A task's input values in a run, as the KFP driver resolves them from the IR: run parameters and constants."""
    spec = pipeline_spec["components"]["comp-exit-handler-1"]["dag"]["tasks"][task]["inputs"]["parameters"]
    parameters = run["runtime_config"]["parameters"]
    values = {}
    for name, source in spec.items():
        if "componentInputParameter" in source:
            values[name] = parameters[source["componentInputParameter"].removeprefix("pipelinechannel--")]
        else:
            constant = source["runtimeValue"]["constant"]
            values[name] = run["run_id"] if constant == "{{$.pipeline_job_uuid}}" else constant
    return values


@pytest.fixture
def kfp_fake():
    with FakeServer() as server:
        yield server


class HoldsNothing:
    """The plan component's backend where there is no cluster: its hold on the run is the base class's, which holds
    nothing (on GKE the run Lease, :func:`multislice.backends.gke.lease.hold_run`)."""

    holding_run = Backend.holding_run


def test_one_compiled_yaml_runs_against_two_clusters_by_run_parameters_only(kfp_fake, gcs, monkeypatch):
    monkeypatch.setattr(cancel, "install", lambda: None)  # the plan component runs in pytest's process here
    # No cluster here: the plan component's hold on the run (its Lease, tests/backends/gke/test_terminate.py) is
    # held by a backend that holds nothing.
    monkeypatch.setattr(run_plan, "backend_of", lambda *args, **kwargs: HoldsNothing())
    where = submission.KfpTarget(host=kfp_fake.url)
    runs = [
        multislice.submit(
            deployment.profile_file("gke-v6e-16x2-seed"),  # a deployment's images, no placeholder left
            {"output_dir": "gs://bucket/runs", "run_name": f"r{n}", **cluster},
            target="kfp",
            kfp=where,
        )  # fmt: skip
        for n, cluster in enumerate(CLUSTERS)
    ]
    # Compiled once: both runs use the one pipeline version, uploaded once.
    assert runs[0].version_id == runs[1].version_id
    assert len(kfp_fake.state.sent("POST", "/pipelines/upload_version")) == 1
    [pipeline_spec, _platform] = kfp_fake.state.templates[runs[0].version_id]
    for run, cluster in zip(runs, CLUSTERS, strict=True):
        sent = kfp_fake.state.runs[run.run_id]
        inputs = task_inputs(pipeline_spec, "plan", sent)
        plan = Plan.from_json(plan_component.plan(**inputs))
        spec = plan.spec
        assert (spec.cluster.project, spec.cluster.location, spec.cluster.name, spec.cluster.access) == (
            cluster["cluster_project"], cluster["cluster_location"], cluster["cluster_name"], cluster["cluster_access"]
        )  # fmt: skip
        assert (spec.node_pools.zone, spec.namespace) == (cluster["zone"], cluster["namespace"])
        # Provision's GKE calls go to this run's cluster.
        gke = FakeGke(cluster["cluster_project"], cluster["cluster_location"], cluster["cluster_name"]).start()
        try:
            report = nodepool.ensure_node_pools(plan, gke.client(), on_progress=lambda _: None, poll_seconds=0.01)
        finally:
            gke.stop()
        parent = (
            f"projects/{cluster['cluster_project']}/locations/{cluster['cluster_location']}/clusters/"
            + (cluster["cluster_name"])
        )
        assert report["cluster"] == parent
        creates = gke.calls("POST")
        assert [path for path, _ in creates] == [f"/v1/{parent}/nodePools"] * 2
        assert {body["nodePool"]["locations"][0] for _, body in creates} == {cluster["zone"]}
        # The exit handler cleans up on the same cluster and namespace.
        cleanup = pipeline_spec["root"]["dag"]["tasks"]["cleanup"]["inputs"]["parameters"]
        names = {cleanup[k]["componentInputParameter"] for k in ("cluster_project", "cluster_name", "namespace")}
        assert {sent["runtime_config"]["parameters"][n] for n in names} == {
            cluster["cluster_project"], cluster["cluster_name"], cluster["namespace"]
        }  # fmt: skip
    # The release the YAML was compiled by travels to the plan task and matches this image's.
    assert inputs["release"] == release.current()


@pytest.mark.parametrize("other", [{"version": "0.0.9"}, {"schema": "0123456789abcdef"}], ids=["version", "schema"])
def test_plan_refuses_a_yaml_of_another_release_first(other):
    from multislice.steps import plan as plan_step

    compiled = {**release.current(), **other}
    with pytest.raises(release.ReleaseMismatch) as raised:
        plan_step.run({"not": "read"}, {}, release=compiled)  # refused before the profile is even read
    assert "\n" not in raised.value.message and raised.value.exit_code == 2
    assert f"compiled by multislice-pipelines {compiled['version']}" in raised.value.message
    assert release.current()["version"] in raised.value.message and "images" in raised.value.fix


def test_the_plan_component_takes_the_parameter_table_and_hands_each_value_to_the_plan_step(monkeypatch):
    """``components/plan.py`` writes its signature out (KFP builds the component from the function's own signature
    and source); it is :mod:`multislice.config.parameters`' table: each run parameter and stage field by name and
    type, none with a default, besides the component's own inputs. Each value reaches the plan step under its
    parameter's name, the stage's under ``stages.<stage>.<field>``."""
    from multislice.config import parameters
    from multislice.steps import plan as plan_step

    signature = inspect.signature(plan_component.plan)
    hints = typing.get_type_hints(plan_component.plan)
    table = {p.name: p.type for p in parameters.RUN_PARAMETERS} | {f: kind for f, kind, _ in parameters.STAGE_FIELDS}
    own = {"profile": dict, "stage": str, "pipeline_run_id": str, "release": dict}
    assert {name: hints[name] for name in signature.parameters} == table | own
    assert {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty} == {"release": {}}

    handed = {}

    def plan_run(profile, values, stage, pipeline_run_id, release, hold=False):
        handed.update(values, stage=stage, pipeline_run_id=pipeline_run_id, hold=hold)
        return types.SimpleNamespace(to_json=lambda: "{}")

    monkeypatch.setattr(cancel, "install", lambda: None)  # the plan component runs in pytest's process here
    monkeypatch.setattr(plan_step, "run", plan_run)
    plan_component.plan(profile={}, stage="s", pipeline_run_id="r", **{name: f"<{name}>" for name in table})
    assert handed == {p.name: f"<{p.name}>" for p in parameters.RUN_PARAMETERS} | {
        f"stages.s.{field}": f"<{field}>" for field, _, _ in parameters.STAGE_FIELDS
    } | {"stage": "s", "pipeline_run_id": "r", "hold": True}  # the component holds the run (its Lease on GKE)
