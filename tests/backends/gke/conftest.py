"""The GKE scenarios' fixtures: kmock's KubernetesEmulator served over HTTP (tests/kube_cluster.py), its
controllers played from the test (tests/kube_controllers.py), the rendered RBAC enforced, the run's storage.

None is autouse: this directory also holds tests that need none of them (test_nodepool, test_pods,
test_access ...), and ``node_pools`` replaces ``ensure_node_pools``. A scenario module names the ones
it needs for every test with ``pytestmark = pytest.mark.usefixtures(...)``.
"""

from __future__ import annotations

import pytest

from multislice import config
from multislice import steps as step_lines
from multislice.backends.gke import GkeBackend, export_pool, nodepool
from multislice.plan import make_plan
from multislice.render import jobset as render_jobset
from multislice.render import kueue, rbac, schema
from multislice.steps import provision
from tests.backends.gke.harness import POOLS, RUN_ID, Told
from tests.kube_cluster import Served
from tests.kube_controllers import Play
from tests.kube_rbac import service_account_user


@pytest.fixture(scope="module")
def crd_schemas():
    """The CRD schemas parsed and their validators built (cached per process) before the first scenario.

    The first validation in a process parses every CRD in multislice/crds: measured 26 s on this 2-core
    machine at load 9. Inside a scenario it would delay admit's first change (the JobSet's creation)
    past a controller script's wait for it; the scenarios are about the cluster, not about this cost.
    """
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", {"run_name": "r1", "output_dir": "gs://bucket/runs"}))
    schema.validate(
        render_jobset.render_jobset(plan, plan.stages[0], hardware=GkeBackend.hardware, pipeline_run_id=RUN_ID)
    )
    for obj in provision.kueue_objects(plan):
        schema.validate(obj)


@pytest.fixture
def served():
    server = Served()
    yield server
    server.stop()


@pytest.fixture
def bare_play(served):
    """The emulated cluster's controllers, with the CRDs and the node pools' nodes; no Kueue objects yet."""
    player = Play(served)
    player.install_crds()
    player.nodes({pool: 4 for pool in POOLS})
    return player


@pytest.fixture
def play(bare_play, plan):
    """:func:`bare_play` with the Kueue objects and Kueue Configuration fragment ``multislice render`` writes for the
    module's ``plan``, as a cluster admin applied them (the Kueue model admits against them, tests/kueue_model.py)."""
    bare_play.install_kueue(provision.kueue_objects(plan), kueue.kueue_configuration(plan))
    return bare_play


@pytest.fixture
def plan():
    spec = config.load_profile(
        "gke-v6e-16x2-seed",
        {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True},
    )
    return make_plan(spec)


@pytest.fixture
def least_privilege(served, plan):
    """Every scenario's steps act as the pipeline's ServiceAccount, under the RBAC ``multislice render`` writes.

    The emulated API enforces the rendered Role and ClusterRoles as the API server does
    (tests/kube_rbac.py): a verb or resource the steps use and RBAC does not grant is a 403 in the scenario.
    """
    accounts = plan.spec.service_accounts
    user = service_account_user(accounts.pipeline_namespace or plan.spec.namespace, accounts.pipeline)
    served.as_user(user, rbac.render_rbac_objects(plan))
    return served.cluster.authorizer


@pytest.fixture
def run_storage(gcs):
    """The run directory is gs://bucket/runs/r1, on Cloud Storage served on 127.0.0.1."""
    return gcs


@pytest.fixture
def node_pools(monkeypatch):
    """``ensure_node_pools`` (tested against its own GKE fake in test_nodepool.py), recorded; the export pool's check
    (tested against the GKE fake in test_export_pool.py) passes."""
    calls = []
    monkeypatch.setattr(export_pool, "check", lambda plan, client=None: [])

    def ensure_node_pools(plan, client=None, *, on_progress=print, deadline=None, pipeline_run_id=""):
        calls.append(plan.spec.run_name)
        on_progress(f"node pools {POOLS} adopted")
        return {"node_pools": [{"name": pool, "action": "adopted"} for pool in POOLS]}

    monkeypatch.setattr(nodepool, "ensure_node_pools", ensure_node_pools)
    return calls


@pytest.fixture
def told(monkeypatch):
    """Every progress line the steps tell (they still print), as a :class:`Told`."""
    lines = Told()
    say = step_lines.say

    def say_and_record(step, message, stage=None):
        say(step, message, stage)
        lines.add(message)

    monkeypatch.setattr(step_lines, "say", say_and_record)  # teller() looks it up at each call
    return lines
