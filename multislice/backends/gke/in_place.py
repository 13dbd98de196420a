"""Whether the cluster accepts in-place restart (:mod:`multislice.render.in_place`), found by provision with dry runs.

Two parts of the cluster must accept it, and each refuses on create, so each is asked with a server-side dry run
(``dryRun=All``: admission and validation run, nothing is stored; every webhook involved declares
``sideEffects: None``):

1. **JobSet's webhook**: the stage's TPU JobSet rendered with ``restartStrategy: InPlaceRestart``, dry-run created.
   JobSet v0.12.0's validating webhook refuses it while the controller's ``InPlaceRestart`` feature gate is off
   (``pkg/webhooks/jobset_webhook.go``, ``ValidateCreate``: "InPlaceRestart restart strategy cannot be set when
   InPlaceRestart feature gate is disabled"; ``pkg/features/features.go``: alpha, default false). A 409 (a JobSet of
   that name exists) comes from storage, after admission: accepted.
2. **The API server's pod validation**: a Job (``batch/v1``) with that JobSet's Job template, dry-run created: what
   the JobSet controller creates, validated with the same pod options as a Pod. Kubernetes builds those options from
   its feature gates (``pkg/api/pod/util.go``, ``GetValidationOptionsFromPodSpecAndMeta``:
   ``AllowContainerRestartPolicyRules`` from ``ContainerRestartRules``, ``AllowRestartAllContainers`` from
   ``RestartAllContainersOnContainerExits``, the latter also allowing rules on sidecars), so with a gate off the
   template's ``restartPolicyRules`` are refused as invalid (422), not dropped; a server that took the Job but
   returned it without the rules is treated as off too. A Job rather than a bare Pod: the pipeline may create Jobs
   (:mod:`multislice.render.rbac`), not Pods. No queue label: Kueue leaves the probe alone, and it is suspended.
   What the kubelets do is not asked: the gates must be on there too (KEP-5532's rollout: a kubelet without it
   ignores the rules and the pod fails instead, then is recreated as under Recreate).

With ``restart_strategy: auto`` a refusal makes provision choose ``Recreate`` and say why and what to enable; with
``in_place`` it is a :class:`InPlaceRestartUnavailable`. The choice is written in the provision report
(``restart_strategy``), which admit reads back from the run directory when it renders the JobSet
(:func:`chosen`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names, reports
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, Kube
from multislice.errors import InputError
from multislice.plan import Plan
from multislice.render import in_place, jobset, launchers

#: What to enable for JobSet's part.
JOBSET_FIX = (
    "run JobSet v0.12.0's controller with --feature-gates=InPlaceRestart=true (its manager Deployment's args, or the "
    "Helm chart's feature gate values); see docs/gke-setup.md"
)
#: What to enable for the API server's and kubelets' part.
KUBERNETES_FIX = (
    "use Kubernetes 1.35 or later with the feature gates ContainerRestartRules and "
    "RestartAllContainersOnContainerExits on the API server and kubelets (on GKE: an alpha cluster at 1.35, or a "
    "version where they are on by default); see docs/gke-setup.md"
)


class InPlaceRestartUnavailable(InputError):
    """``restart_strategy: in_place`` on a cluster that refuses it; the message says which part, the fix what to
    enable (or ``restart_strategy: auto``)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What provision chose: ``strategy`` (``InPlaceRestart`` or ``Recreate``), why (``reason``, '' when in place as
    asked) and what would let the run restart in place (``fix``, '' when nothing)."""

    strategy: in_place.Strategy
    reason: str = ""
    fix: str = ""

    def line(self, setting: str) -> str:
        """One progress line: the strategy and, for a fallback, why and the fix."""
        if self.strategy == in_place.IN_PLACE:
            return f"restart strategy: InPlaceRestart (restart_strategy {setting}): {self.reason}"
        tail = f"; to restart in place: {self.fix}" if self.fix else ""
        return f"restart strategy: Recreate (restart_strategy {setting}): {self.reason}{tail}"


def _refusal(error: ApiException) -> str:
    """The API server's message of a refused request (its Status ``message``), else the raw body."""
    try:
        return str(json.loads(error.body or "{}").get("message") or error.body or error.reason)
    except (ValueError, AttributeError):
        return str(error.body or error.reason)


def _jobset_refusal(kube: Kube, manifest: dict[str, Any]) -> str | None:
    """JobSet's webhook on the in-place JobSet (dry run); None when accepted."""
    try:
        kube.call(
            kube.custom.create_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, kube.namespace, JOBSET_PLURAL,
            manifest, dry_run="All", what=f"dry-run create JobSet {manifest['metadata']['name']} (InPlaceRestart)",
        )  # fmt: skip
    except ApiException as error:
        if error.status == 409:  # AlreadyExists is storage's answer, after admission accepted it
            return None
        return f"JobSet refused restartStrategy InPlaceRestart in a dry run (HTTP {error.status}: {_refusal(error)})"
    return None


def _rules_kept(job: dict[str, Any]) -> bool:
    """Whether every container of the Job's pod template that was rendered with ``restartPolicyRules`` kept them."""
    pod = job.get("spec", {}).get("template", {}).get("spec", {})
    containers = [*pod.get("initContainers", []), *pod.get("containers", [])]
    return all(c.get("restartPolicyRules") for c in containers if c.get("name") in
               (in_place.AGENT_CONTAINER, names.TRAINER_CONTAINER))  # fmt: skip


def _pod_refusal(kube: Kube, manifest: dict[str, Any]) -> str | None:
    """The API server's pod validation on the JobSet's Job template (dry run of a Job); None when accepted."""
    template = manifest["spec"]["replicatedJobs"][0]["template"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": "in-place-restart-check-", "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}},
        "spec": {**template["spec"], "suspend": True},
    }
    try:
        stored = kube.call(
            kube.batch.create_namespaced_job, kube.namespace, job, dry_run="All", _preload_content=False,
            what="dry-run create a Job with the JobSet's pod template (restartPolicyRules RestartAllContainers)",
        )  # fmt: skip
    except ApiException as error:
        return (
            f"the API server refused restartPolicyRules with action RestartAllContainers in a dry run (HTTP "
            f"{error.status}: {_refusal(error)})"
        )
    if not _rules_kept(json.loads(stored.data)):
        return "the API server dropped restartPolicyRules from a dry-run Job (its feature gates are off)"
    return None


def check(kube: Kube, plan: Plan, manifest: dict[str, Any]) -> Decision:
    """Ask the cluster (dry runs, module docstring) whether ``manifest``, a stage's TPU JobSet rendered with
    ``InPlaceRestart``, would be accepted; decide by ``restart_strategy``.

    Raises:
        InPlaceRestartUnavailable: ``restart_strategy: in_place`` and a part refuses.
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    setting = plan.spec.restart_strategy
    if setting == "recreate":
        return Decision(in_place.RECREATE, "as the profile sets it")
    refused, fix = _jobset_refusal(kube, manifest), JOBSET_FIX
    if refused is None:
        refused, fix = _pod_refusal(kube, manifest), KUBERNETES_FIX
    if refused is None:
        return Decision(in_place.IN_PLACE, "the cluster's JobSet and API server accept it (dry runs)")
    if setting == "in_place":
        raise InPlaceRestartUnavailable(
            f"restart_strategy in_place, but {refused}; nothing was created",
            f"{fix}; or set restart_strategy: auto to fall back to Recreate",
        )
    return Decision(in_place.RECREATE, refused, fix)


def check_plan(kube: Kube, plan: Plan) -> Decision | None:
    """:func:`check` on the plan's first stage launched as a JobSet (every such stage renders the same pod template
    parts it asks about); None when no stage is."""
    stages = [stage for stage in plan.stages if launchers.kind_of(stage).name == "jobset"]
    if not stages:
        return None
    manifest = jobset.render_jobset(
        plan, stages[0], hardware="tpu", pipeline_run_id="", restart_strategy=in_place.IN_PLACE
    )
    return check(kube, plan, manifest)


def chosen(plan: Plan) -> in_place.Strategy:
    """The strategy a TPU JobSet of the plan is created with: what provision chose (its report in the run
    directory); without a provision report, ``InPlaceRestart`` for ``restart_strategy: in_place`` and ``Recreate``
    otherwise (auto without a check takes the strategy every cluster accepts)."""
    report = reports.read(reports.ProvisionReport, plan)
    if report is not None and report.restart_strategy in (in_place.IN_PLACE, in_place.RECREATE):
        return report.restart_strategy  # type: ignore[return-value]
    return in_place.IN_PLACE if plan.spec.restart_strategy == "in_place" else in_place.RECREATE
