"""What a stage's launcher renders and needs, the same on every backend: the render side of the launcher interface.

A stage is launched as a JobSet (``launcher: jobset``, :mod:`multislice.render.jobset`) or as a KubeRay RayJob
(``launcher: ray``, :mod:`multislice.render.ray`). :func:`kind_of` is the one place that reads a stage's
``launcher``; rendering (:mod:`multislice.backends.manifests`, :mod:`multislice.render.rbac`), provisioning (the
node pools' DRANET label) and each backend's launcher (:class:`multislice.backends.launcher.Launcher`, which pairs
one of these with the calls that create, wait on, follow and delete its workload) ask the :class:`LauncherKind` it
returns instead of comparing names. A new launcher is one more subclass here and one more
:class:`~multislice.backends.launcher.Launcher` per backend that runs it; no branch elsewhere.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from multislice.config import parameters
from multislice.plan import Plan, StagePlan
from multislice.render import in_place, jobset
from multislice.render.jobset import Hardware


class LauncherKind(abc.ABC):
    """How one kind of launcher renders a stage (no cluster calls).

    Attributes:
        name: The value of a stage's ``launcher`` (``jobset``, ``ray``).
        kind: The object it launches on TPU (``JobSet``, ``RayJob``).
        claims_dranet: Whether its TPU pods claim DRANET network devices when the node pools have additional networks
            (the node pools then carry DRANET's driver label, :func:`multislice.backends.gke.nodepool`).
        restarts_are: What a train report's ``restarts`` count for it (the CLI's summary).
    """

    name: ClassVar[str]
    kind: ClassVar[str]
    claims_dranet: ClassVar[bool] = False
    restarts_are: ClassVar[str]

    @abc.abstractmethod
    def render(self, plan: Plan, stage: StagePlan, hardware: Hardware, pipeline_run_id: str) -> dict[str, Any]:
        """The workload that trains ``stage`` for ``hardware`` (``tpu``: GKE; ``cpu``: the local backend).

        Raises:
            ValueError: ``pipeline_run_id`` is not a valid label value.
        """

    def companions(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> list[dict[str, Any]]:
        """Objects created before the TPU workload, with it (none by default)."""
        return []

    def rbac_rules(self) -> list[dict[str, Any]]:
        """Role rules the pipeline needs, besides the JobSet's, for a run with a stage of this launcher (RBAC rule
        objects, ``rbac.authorization.k8s.io/v1`` ``PolicyRule``); none by default."""
        return []

    def cluster_rbac_rules(self) -> list[dict[str, Any]]:
        """Cluster-wide read rules the pipeline needs for this launcher (its ClusterRole; provision's prerequisite
        checks); none by default."""
        return []


class JobSetKind(LauncherKind):
    """A stage as one multislice JobSet (:func:`multislice.render.jobset.render_jobset`), on both backends."""

    name = "jobset"
    kind = "JobSet"
    restarts_are = "JobSet restarts"

    def render(
        self,
        plan: Plan,
        stage: StagePlan,
        hardware: Hardware,
        pipeline_run_id: str,
        restart_strategy: in_place.Strategy | None = None,
    ) -> dict[str, Any]:
        """The stage's multislice JobSet for ``hardware``, restarting by ``restart_strategy`` (None: the dry run's,
        :func:`multislice.render.in_place.requested`)."""
        return jobset.render_jobset(
            plan, stage, hardware=hardware, pipeline_run_id=pipeline_run_id, restart_strategy=restart_strategy
        )


class RayJobKind(LauncherKind):
    """A stage as a KubeRay RayJob on TPU (:func:`multislice.render.ray.render_rayjob`) with its DRANET claim
    templates; on CPU (the local backend) the one-pod JobSet of its Ray driver
    (:func:`multislice.render.jobset.render_ray_driver_jobset`), whose Ray Train retries workers itself."""

    name = "ray"
    kind = "RayJob"
    claims_dranet = True
    restarts_are = "Ray Train retries (launcher ray)"

    def render(self, plan: Plan, stage: StagePlan, hardware: Hardware, pipeline_run_id: str) -> dict[str, Any]:
        """The RayJob (``tpu``) or the local driver's JobSet (``cpu``)."""
        if hardware == "cpu":
            return jobset.render_ray_driver_jobset(plan, stage, hardware=hardware, pipeline_run_id=pipeline_run_id)
        from multislice.render import ray  # jsonschema: only for a Ray stage

        return ray.render_rayjob(plan, stage, pipeline_run_id=pipeline_run_id)

    def companions(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> list[dict[str, Any]]:
        """The DRANET ResourceClaimTemplates of the stage's TPU workers (none without additional node networks):
        the RayJob's worker pods cannot be created without them."""
        from multislice.render import ray  # jsonschema: only for a Ray stage

        return ray.render_claim_templates(plan, stage, pipeline_run_id=pipeline_run_id)

    def rbac_rules(self) -> list[dict[str, Any]]:
        """The stage's RayJob (admit creates it, launch and train read its status, cleanup deletes it) and its DRANET
        ResourceClaimTemplates (admit creates, cleanup deletes).

        No ``rayclusters`` rule: the backend reads the RayCluster's state from the RayJob's
        ``status.rayClusterStatus`` and its pods by label, and deleting the RayJob removes the RayCluster (an owned
        object, :mod:`multislice.backends.gke.rayjob`). No ``rayjobs/status``: a status is read with the object.
        """
        return [
            {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get", "list", "watch", "create", "delete"]},
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"],
             "verbs": ["get", "list", "create", "delete"]},
        ]  # fmt: skip

    def cluster_rbac_rules(self) -> list[dict[str, Any]]:
        """Get the KubeRay TPU webhook's MutatingWebhookConfiguration, by name only (provision checks it is
        installed, :mod:`multislice.backends.gke.prerequisites`). No ``list``: the webhook's manifests fix the name
        (:data:`TPU_WEBHOOK_CONFIGURATION`), and GKE's Ray Operator add-on is read from the GKE API instead."""
        return [
            {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
             "verbs": ["get"], "resourceNames": [TPU_WEBHOOK_CONFIGURATION]},
        ]  # fmt: skip


#: The KubeRay TPU webhook's MutatingWebhookConfiguration (GoogleCloudPlatform/ai-on-gke, commit 2561974a,
#: ``ray-on-gke/tpu/kuberay-tpu-webhook/deployments/mutating-webhook-cfg.yaml`` and the Helm chart's
#: ``templates/mutating-webhook-cfg.yaml``: the same fixed name; now developed in ai-on-gke/kuberay-tpu-webhook).
TPU_WEBHOOK_CONFIGURATION = "kuberay-tpu-mutating-webhook-cfg"


#: Every launcher kind, by the ``launcher`` value that selects it (:class:`multislice.config.RunSpec`).
KINDS: dict[str, LauncherKind] = {kind.name: kind for kind in (JobSetKind(), RayJobKind())}


def named(name: str) -> LauncherKind:
    """The launcher kind of a ``launcher`` value (a report's ``launcher`` field).

    Raises:
        ValueError: an unknown name (the config's ``Literal`` refuses one before a plan exists).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown launcher {name!r}; use one of {', '.join(KINDS)}") from None


def kind_of(stage: StagePlan) -> LauncherKind:
    """The launcher kind of ``stage``: the one place that reads ``StagePlan.launcher``."""
    return named(stage.launcher)


def offered_kinds(plan: Plan) -> list[LauncherKind]:
    """The launcher kinds a run of the plan's compiled pipeline may use: the plan's own (:func:`kinds_of`) and, when
    the run form offers ``launcher`` (:func:`multislice.config.parameters.remote_run_sets`), every kind, in
    :data:`KINDS` order after the plan's. What the RBAC and the cluster's prerequisites are rendered for, so that
    picking another launcher in the run form is not a 403 after node pools were created."""
    found = kinds_of(plan)
    if parameters.remote_run_sets("launcher"):
        found += [kind for kind in KINDS.values() if kind not in found]
    return found


def kinds_of(plan: Plan) -> list[LauncherKind]:
    """The distinct launcher kinds of the plan's stages, in stage order."""
    found: list[LauncherKind] = []
    for stage in plan.stages:
        if kind_of(stage) not in found:
            found.append(kind_of(stage))
    return found
