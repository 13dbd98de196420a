"""The GKE backend: a run's workloads on a GKE cluster.

Capacity through the GKE API (:mod:`.nodepool`); JobSets, Kueue Workloads,
pods, logs and Jobs through the Kubernetes API (:class:`.client.Kube`, every
call retried by :mod:`.retry`). Sources of the fields read are named in each
module. What the tests' emulated API does not model (RBAC, admission
webhooks, controllers, the scheduler) is listed in ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.base import (
    Admission,
    Backend,
    Finished,
    LaunchFailed,
    PodExit,
    Running,
    Submission,
    Tell,
    TrainingFailed,
    VerifierTimeout,
    WorkloadDeleted,
)
from multislice.backends.gke import (
    access,
    cluster,
    exporter,
    jobset,
    lease,
    logs,
    nodepool,
    pods,
    rayjob,
    verifier,
    watch,
    workload,
)
from multislice.backends.gke import elastic as gke_elastic
from multislice.backends.gke.aot import JobAotSession
from multislice.backends.gke.client import FIELD_MANAGER, JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, Kube
from multislice.config import ClusterSpec
from multislice.plan import Plan, StagePlan
from multislice.preflight import CompileSession
from multislice.render import ray as render_ray
from multislice.reports import ExportReport, PodPlacement, ProvisionReport, VerificationReport
from multislice.timings import DEFAULTS, Timings

#: Last lines of a failed pod's log quoted in a failure report.
TAIL_LINES = 25


def waiting_states(current: list[Any], running: list[Any]) -> list[str]:
    """Why the pods not yet Running wait: their Unschedulable messages, else their phases."""
    return sorted({pods.unschedulable(p) or p.status.phase for p in current if p not in running})


def capacity_wait(plan: Plan, unschedulable_since: dict[str, float], now: float, grace: float) -> str:
    """With flex-start node pools and pods Unschedulable: ``; Unschedulable for N s, flex-start: waiting up to G s
    for capacity`` (Dynamic Workload Scheduler finding the slices is not a failure within that wait,
    :func:`multislice.timings.timings_for`); else empty."""
    if not unschedulable_since or plan.spec.node_pools.provisioning != "flex-start":
        return ""
    longest = now - min(unschedulable_since.values())
    return f"; Unschedulable for {longest:.0f} s, flex-start: waiting up to {grace:.0f} s for capacity"


def _owned(obj: dict[str, Any], owner: str) -> bool:
    """Whether a workload was created by pipeline run ``owner`` (its ``pipeline/runid`` label)."""
    return bool(owner) and (obj["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID) == owner


class GkeBackend(Backend):
    """Acts on a GKE cluster through its Kubernetes API (``kube``) and the GKE API (node pools).

    Args:
        kube: The API client bound to the run's namespace; its ``timings`` are this backend's waits.
    """

    name = "gke"
    hardware = "tpu"
    elastic = True

    def __init__(self, kube: Kube, lease_seconds: int = lease.LEASE_SECONDS):
        super().__init__(kube.timings)
        self.kube = kube
        self.lease_seconds = lease_seconds
        self.holders: list[lease.Holder] = []  # the Lease holders of the steps run through this backend
        self.following: str | None = None  # the JobSet last submitted or followed
        self.run_ids: dict[str, str] = {}  # JobSet -> its pipeline run label, kept across an elastic relaunch
        self._claims: dict[str, list[dict[str, Any]]] = {}  # RayJob name -> its DRANET claim templates

    @classmethod
    def connect(
        cls,
        cluster: ClusterSpec,
        namespace: str,
        timings: Timings | None = None,
        say: Callable[[str], None] | None = None,
    ) -> GkeBackend:
        """Reach the cluster as ``cluster.access`` says (:mod:`.access`).

        Args:
            say: Where API retry notices go (one line each).

        Raises:
            access.ClusterAccessError: the cluster cannot be reached as configured.
        """
        return cls(Kube(access.api_client(cluster), namespace, timings or DEFAULTS["gke"], say))

    @classmethod
    def where_logs_are(cls, plan: Plan) -> str:
        """``kubectl logs`` of a stage's JobSet pods (the leader: slice 0, host 0)."""
        return (
            f"kubectl logs -n {plan.spec.namespace} -l {names.JOBSET_NAME_KEY}=<jobset> -c {names.TRAINER_CONTAINER} "
            "(cluster logging keeps them after the pods go)"
        )

    # -- capacity ---------------------------------------------------------

    def provision(self, plan: Plan, kueue_objects: list[dict[str, Any]], tell: Tell) -> ProvisionReport:
        """TPU node pools (:func:`.nodepool.ensure_node_pools`), the CRDs served, the Kueue objects applied.

        The LocalQueue is always applied (server-side apply, fixed field manager); the
        cluster-scoped objects only with ``service_accounts.kueue_cluster_objects``, else
        RBAC leaves them to a cluster admin (:mod:`multislice.render.rbac`).

        Raises:
            cluster.CrdsMissing: JobSet or Kueue (or, for a stage launched by Ray, KubeRay) not installed at the
                needed versions.
            nodepool.NodePoolError: a node pool is missing (unmanaged), mismatched, or its creation failed.
        """
        pools = nodepool.ensure_node_pools(
            plan, on_progress=tell, deadline=time.monotonic() + self.timings.provision_timeout
        )
        crds = cluster.check_crds(self.kube, ray=any(stage.launcher == "ray" for stage in plan.stages))
        tell("CRDs served: " + ", ".join(f"{name} {'/'.join(versions)}" for name, versions in crds.items()))
        applied, left = [], []
        for obj in kueue_objects:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            if "namespace" not in obj["metadata"] and not plan.spec.service_accounts.kueue_cluster_objects:
                left.append(name)
                continue
            stored = cluster.server_side_apply(self.kube, obj)
            applied.append(name)
            version = stored.get("metadata", {}).get("resourceVersion")
            tell(f"applied {name} (field manager {FIELD_MANAGER}, resourceVersion {version})")
        if left:
            tell(
                "not applied (cluster-scoped, service_accounts.kueue_cluster_objects is false; a cluster admin "
                f"applies them from `multislice render`): {', '.join(left)}"
            )
        return ProvisionReport(
            backend=self.name,
            node_pools=list(pools.get("node_pools", [])),
            crds=crds,
            kueue_objects=applied,
            kueue_objects_left_to_admin=left,
            field_manager=FIELD_MANAGER,
            namespace=self.kube.namespace,
        )

    # -- a stage's workload -------------------------------------------------

    def workload_manifest(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's JobSet, or with ``launcher: ray`` its RayJob (:func:`multislice.render.ray.render_rayjob`).

        A RayJob's DRANET ResourceClaimTemplates (when the node pools have additional networks) are rendered with it
        and created by :meth:`submit` before the RayJob.
        """
        if stage.launcher != "ray":
            return super().workload_manifest(plan, stage, pipeline_run_id)
        manifest = render_ray.render_rayjob(plan, stage, pipeline_run_id=pipeline_run_id)
        self._claims[stage.jobset] = render_ray.render_claim_templates(plan, stage, pipeline_run_id=pipeline_run_id)
        return manifest

    def _launcher(self, stage: StagePlan) -> str:
        return "RayJob" if stage.launcher == "ray" else "JobSet"

    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the JobSet (or RayJob) with its spec-hash annotation, adopt it when the hash matches, or replace a
        finished one of another pipeline run (:mod:`.jobset`, :mod:`.rayjob`). A RayJob's claim templates are
        created first: its worker pods cannot be created without them."""
        replaced: list[str] = []
        self.following = manifest["metadata"]["name"]
        if manifest.get("kind") == "RayJob":
            for template in self._claims.get(manifest["metadata"]["name"], []):
                rayjob.apply_claim_template(self.kube, template)
            created, adopted = rayjob.create_or_adopt(self.kube, manifest, replaced)
        else:
            created, adopted = jobset.create_or_adopt(self.kube, manifest, replaced)
        return Submission(
            name=manifest["metadata"]["name"],
            adopted=adopted,
            uid=created["metadata"].get("uid"),
            replaced=replaced[-1] if replaced else None,
        )

    def wait_admitted(self, plan: Plan, stage: StagePlan, tell: Tell) -> Admission:
        """Wait for the JobSet's Kueue Workload to be Admitted, telling the pending reason (:mod:`.workload`)."""
        ray = stage.launcher == "ray"
        admitted, waited = workload.wait_admitted(
            self.kube, stage.jobset, plan.spec.queue, timeout=self.timings.admit_timeout, on_progress=tell,
            kind=self._launcher(stage), get=rayjob.get if ray else None,
        )  # fmt: skip
        where = workload.admission(admitted)
        return Admission(
            cluster_queue=where["cluster_queue"],
            flavors=where["flavors"],
            wait_seconds=round(waited, 2),
            workload=admitted["metadata"]["name"],
        )

    def _pod_line(self, pod: Any, cause: str) -> str:
        events = pods.events(self.kube, pod.metadata.name)
        return f"pod {pod.metadata.name} (slice {pods.slice_index(pod)}, host {pods.host_index(pod)}) {cause}" + (
            f"; its events:\n{events}" if events else ""
        )

    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait for every pod of the current attempt to run; check one slice per node pool.

        Fails at once on image pulls and crash loops; on pods Unschedulable past
        ``timings.unschedulable_grace``, quoting their events.
        """
        if stage.launcher == "ray":
            return self._ray_wait_running(plan, stage, tell)
        timings = self.timings
        expected = plan.spec.num_slices * plan.slice.hosts
        started = time.monotonic()
        unschedulable_since: dict[str, float] = {}
        last_report = 0.0
        while True:
            js = self.kube.get_jobset(stage.jobset)
            if js is None:
                raise WorkloadDeleted(f"JobSet {stage.jobset} was deleted before all its pods ran")
            state = jobset.phase(js)
            if state == "Failed":
                raise LaunchFailed(f"JobSet {stage.jobset} failed before all its pods ran: {jobset.describe(js)}")
            current = pods.list_pods(self.kube, stage.jobset, jobset.restarts(js))
            now = time.monotonic()
            self._check_pods_can_start(plan, current, unschedulable_since, now)
            running = [p for p in current if p.status.phase == "Running"]
            if state == "Completed" or (state == "Running" and len(running) == expected):
                break
            if now - last_report >= timings.report_seconds:
                others = waiting_states(current, running)
                tell(
                    f"{len(running)}/{expected} pods Running; JobSet {state}; others: {others}"
                    + capacity_wait(plan, unschedulable_since, now, timings.unschedulable_grace)
                )
                last_report = now
            if now - started > timings.launch_timeout:
                raise LaunchFailed(
                    f"JobSet {stage.jobset}: {len(running)}/{expected} pods Running after "
                    f"{timings.launch_timeout:.0f} s; others: {waiting_states(current, running)}",
                    "check the pods' events (kubectl describe pod); raise timeouts.launch if start-up is slow",
                )
            time.sleep(timings.poll_seconds)
        placement = self._placement(
            running, state, f"JobSet {stage.jobset}",
            "check the JobSet's exclusive-topology annotation and that JobSet's webhook is installed",
        )  # fmt: skip
        return Running(placement=placement, node_pools=sorted({str(p.node_pool) for p in placement.values()}))

    def _placement(self, running: list[Any], state: str, what: str, fix: str) -> dict[str, PodPlacement]:
        """Where the running pods are (pod name -> node and node pool).

        Raises:
            LaunchFailed: a workload still running is not placed one slice per node pool (``fix`` says what to check).
        """
        where = pods.placement(self.kube, running)
        problems = pods.exclusive_placement_problems(where) if state != "Completed" else []
        if problems:
            raise LaunchFailed(f"{what} is not placed one slice per node pool: {'; '.join(problems)}", fix)
        return {name: PodPlacement(**info) for name, info in where.items()}

    def _check_pods_can_start(
        self, plan: Plan, current: list[Any], unschedulable_since: dict[str, float], now: float
    ) -> None:
        """Fail launch on a pod that cannot start: an image or container error, or Unschedulable for longer than
        ``timings.unschedulable_grace`` seconds (with flex-start, the capacity wait). ``unschedulable_since`` (pod
        name -> monotonic seconds) is kept across polls by the caller.

        Raises:
            LaunchFailed: the pod's line and a fix (flex-start: the capacity wait and the zone).
        """
        for pod in current:
            problem = pods.waiting_problem(pod)
            if problem:
                raise LaunchFailed(
                    self._pod_line(pod, f"cannot start: {problem}"),
                    f"check the image reference {plan.spec.images.trainer!r} and that the nodes may pull it "
                    "(Artifact Registry reader role for the node service account)",
                )
            message = pods.unschedulable(pod)
            if message is None:
                unschedulable_since.pop(pod.metadata.name, None)
                continue
            since = unschedulable_since.setdefault(pod.metadata.name, now)
            if now - since > self.timings.unschedulable_grace:
                flex = plan.spec.node_pools.provisioning == "flex-start"
                raise LaunchFailed(
                    self._pod_line(pod, f"Unschedulable for {now - since:.0f} s: {message}"),
                    f"check that {plan.spec.num_slices} TPU node pools of {plan.slice.name} "
                    f"(topology {plan.slice.topology}, {plan.slice.machine_type}) exist and are ready"
                    + (
                        "; flex-start found no capacity in that time: raise "
                        "node_pools.max_wait_for_capacity_seconds or try another node_pools.zone"
                        if flex
                        else ""
                    ),
                )

    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Watch the JobSet (re-listing after 410 Gone) and follow its leader's log across restarts.

        Tells restarts and Kueue evictions (the JobSet suspended again) while it
        waits to be admitted again, up to ``timings.readmit_timeout``.
        """
        if stage.launcher == "ray":
            return self._ray_follow(plan, stage, on_line, tell)
        timings = self.timings
        self.following = stage.jobset
        follower = logs.LeaderLog(self.kube, stage.jobset, lambda pod, line: on_line(line), timings.poll_seconds)
        follower.start()
        started = time.monotonic()
        seen_restarts, suspended_since, final = 0, None, None
        causes: list[str] = []
        try:
            # An elastic stage's lost slice shows in pods and nodes, not in the JobSet: each watch request then
            # lasts at most poll_seconds, and ``interrupt`` is asked after each event and each idle end.
            events = watch.follow(
                self.kube, self.kube.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION,
                self.kube.namespace, JOBSET_PLURAL, field_selector=f"metadata.name={stage.jobset}",
                what=f"JobSet {stage.jobset}", deadline=started + timings.train_timeout, on_relist=tell,
                watch_seconds=None if interrupt is None else max(1.0, timings.poll_seconds),
            )  # fmt: skip
            for kind, js in events:
                if kind == watch.IDLE:
                    js = self.kube.get_jobset(stage.jobset)
                    if js is None:
                        kind = "DELETED"
                if kind == "DELETED":
                    raise WorkloadDeleted(f"JobSet {stage.jobset} was deleted during training")
                state = jobset.phase(js)
                if jobset.restarts(js) != seen_restarts:
                    causes += [
                        pods.attempt_failure(self.kube, stage.jobset, a)
                        for a in range(seen_restarts, jobset.restarts(js))
                    ]
                    seen_restarts = jobset.restarts(js)
                    count = f"{seen_restarts}/{plan.spec.max_restarts}"
                    tell(f"JobSet restarted ({count} restarts); following the new leader")
                    tell(f"restart {seen_restarts} cause: {causes[-1]}")
                if state == "Suspended":
                    if suspended_since is None:
                        suspended_since = time.monotonic()
                        found = workload.find(self.kube, js)
                        reason = workload.pending_reason(found, stage.jobset, plan.spec.queue)
                        tell(f"JobSet suspended by Kueue ({reason}); waiting to be admitted again")
                    elif time.monotonic() - suspended_since > timings.readmit_timeout:
                        raise TrainingFailed(
                            f"JobSet {stage.jobset} evicted and not admitted again within "
                            f"{timings.readmit_timeout:.0f} s",
                            "free capacity in the ClusterQueue, or raise timeouts.readmit",
                        )
                elif suspended_since is not None:
                    tell(f"JobSet admitted again after {time.monotonic() - suspended_since:.0f} s; training resumes")
                    suspended_since = None
                if state in ("Completed", "Failed"):
                    final = js
                    break
                if interrupt is not None and interrupt():
                    # Stop the pods first, then pass on what the leader logged up to then.
                    labels = js.get("metadata", {}).get("labels") or {}
                    if names.LABEL_PIPELINE_RUN_ID in labels:
                        self.run_ids[stage.jobset] = labels[names.LABEL_PIPELINE_RUN_ID]
                    jobset.delete(self.kube, stage.jobset)
                    jobset.wait_gone(self.kube, stage.jobset, timings.delete_timeout)
                    follower.stop()
                    follower.join(timeout=timings.poll_seconds * 4 + 5)
                    follower.catch_up()
                    return Finished(
                        phase="Interrupted",
                        restarts=jobset.restarts(js),
                        leader_logs=follower.pods_followed,
                        restart_causes=causes,
                    )
        finally:
            follower.stop()
        if final is None:
            raise TrainingFailed(
                f"JobSet {stage.jobset} still running after {timings.train_timeout:.0f} s",
                "raise timeouts.train if the stage needs longer",
            )
        follower.join(timeout=timings.poll_seconds * 4 + 5)
        follower.catch_up()
        for attempt in range(seen_restarts, jobset.restarts(final)):  # restarts the watch did not see one by one
            causes.append(pods.attempt_failure(self.kube, stage.jobset, attempt))
        return Finished(phase=jobset.phase(final), restarts=jobset.restarts(final), leader_logs=follower.pods_followed,
                        restart_causes=causes)  # fmt: skip

    # -- elastic training ----------------------------------------------------

    def lost_slice(self, name: str) -> str | None:
        """Why JobSet ``name`` lost a slice: a pod of its current attempt failed or was disrupted, its node went
        (deleted, Spot termination, NotReady) or it is Unschedulable (:func:`.elastic.lost_slice`); else None."""
        return gke_elastic.lost_slice(self.kube, name)

    def available_slices(self, plan: Plan) -> int | None:
        """Slices the ClusterQueue can admit beside the other workloads and the node pools hold ready nodes for
        (:func:`.elastic.available`; approximations listed there)."""
        return gke_elastic.available(self.kube, plan, self.following or "")

    def relaunch(self, plan: Plan, stage: StagePlan, tell: Tell) -> None:
        """Delete the stage's JobSet, create it for ``plan.spec.num_slices`` slices (its gradient accumulation in the
        trainer's arguments) with the same pipeline run label, and wait for Kueue to admit the new request."""
        old = self.kube.get_jobset(stage.jobset)
        labels = (old or {}).get("metadata", {}).get("labels") or {}
        run_id = labels.get(names.LABEL_PIPELINE_RUN_ID) or self.run_ids.get(stage.jobset, "manual")
        if old is not None:
            jobset.delete(self.kube, stage.jobset)
            jobset.wait_gone(self.kube, stage.jobset, self.timings.delete_timeout)
        self.submit(self.workload_manifest(plan, stage, run_id))
        tell(f"JobSet {stage.jobset} relaunched on {plan.spec.num_slices} slice(s); waiting for Kueue to admit it")
        admitted = self.wait_admitted(plan, stage, tell)
        tell(f"JobSet {stage.jobset} admitted on {plan.spec.num_slices} slice(s) after {admitted.wait_seconds:g} s")

    def failure_report(self, name: str) -> str:
        """The JobSet's conditions and restarts, then each failed pod's exit code and last log lines."""
        js = self.kube.get_jobset(name)
        if js is None:
            found = rayjob.get(self.kube, name)
            return self._ray_failure_report(found) if found else f"JobSet {name} does not exist"
        lines = [f"JobSet {name} {jobset.describe(js)}"]
        for pod in pods.list_pods(self.kube, name):
            code = pods.exit_code(pod)
            if pod.status.phase == "Failed" or code not in (None, 0):
                lines.append(
                    f"pod {pod.metadata.name} (slice {pods.slice_index(pod)}, host {pods.host_index(pod)}, attempt "
                    f"{pods.attempt(pod)}) exit code {code}; last log lines:"
                )
                lines.append(logs.tail(self.kube, pod.metadata.name, TAIL_LINES))
        return "\n".join(lines)

    def pod_exits(self, name: str) -> list[PodExit]:
        """Each pod of the JobSet's latest restart attempt: slice and host from its JobSet labels, the trainer
        container's exit code and ``finishedAt`` from its terminated state."""
        found = pods.list_pods(self.kube, name)
        latest = max((pods.attempt(p) for p in found), default=0)
        exits = []
        for pod in found:
            if pods.attempt(pod) != latest:
                continue
            finished = None
            for status in pod.status.container_statuses or []:
                terminated = status.state and status.state.terminated
                if status.name == names.TRAINER_CONTAINER and terminated and terminated.finished_at:
                    finished = terminated.finished_at.timestamp()
            exits.append(PodExit(pods.slice_index(pod), pods.host_index(pod), pods.exit_code(pod), finished))
        return exits

    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Delete the JobSet (or the RayJob and its claim templates) with foreground propagation (its Jobs and pods,
        or its RayCluster and submitter Job, go first). Returns once the API server accepted the deletion; the
        kubelets stop the pods after that.

        With ``owner`` (a pipeline run id): only when the object's ``pipeline/runid`` label is ``owner``, deleted
        with a ``uid`` precondition on the object read, so one another run created meanwhile is left. With
        ``grace_seconds`` (a JobSet), its pods (those of ``owner`` only) are deleted too with that
        ``gracePeriodSeconds`` (core v1 ``DeleteOptions``), overriding their ``terminationGracePeriodSeconds``.
        """
        found = self.kube.get_jobset(name)
        if found is not None:
            if owner is not None and not _owned(found, owner):
                return False
            gone = jobset.delete(self.kube, name, found["metadata"].get("uid") if owner is not None else None)
            if gone and grace_seconds is not None:
                self._delete_pods(name, owner, grace_seconds)
            return gone
        found = rayjob.get(self.kube, name)
        if found is None or (owner is not None and not _owned(found, owner)):
            return False
        gone = rayjob.delete(self.kube, name, found["metadata"].get("uid") if owner is not None else None)
        labels = found["metadata"].get("labels") or {}
        keys = (names.LABEL_PIPELINE_RUN_ID, names.LABEL_STAGE)
        if all(labels.get(key) for key in keys):
            rayjob.delete_claim_templates(self.kube, ",".join(f"{key}={labels[key]}" for key in keys))
        return gone

    def _delete_pods(self, name: str, owner: str | None, grace_seconds: float) -> None:
        """Delete the JobSet's pods (only ``owner``'s) with ``grace_seconds``; pods already gone are skipped."""
        for pod in pods.list_pods(self.kube, name):
            if owner is not None and (pod.metadata.labels or {}).get(names.LABEL_PIPELINE_RUN_ID) != owner:
                continue
            try:
                self.kube.call(
                    self.kube.core.delete_namespaced_pod, pod.metadata.name, self.kube.namespace,
                    grace_period_seconds=max(0, math.ceil(grace_seconds)), what=f"delete pod {pod.metadata.name}",
                )  # fmt: skip
            except ApiException as error:
                if error.status != 404:
                    raise

    def workload_phase(self, name: str) -> str | None:
        """The JobSet's phase (:func:`.jobset.phase`), or None when it does not exist."""
        found = self.kube.get_jobset(name)
        return None if found is None else jobset.phase(found)

    def host_log(
        self,
        name: str,
        slice_index: int,
        host: int,
        on_line: Callable[[str], None],
        follow: bool = False,
        tail: int | None = None,
    ) -> bool:
        """Pass on the log of the newest pod of (slice, host) from the API server (the kubelet's copy: gone with
        the pod); following, with :class:`.logs.LeaderLog` pointed at that pod, until it ended. False when the
        JobSet has no such pod (it was deleted, or the pod is not created yet)."""

        def find() -> Any:
            found = [p for p in pods.list_pods(self.kube, name)
                     if (pods.slice_index(p), pods.host_index(p)) == (slice_index, host)]  # fmt: skip
            return max(found, key=pods.attempt, default=None)

        if find() is None:
            return False
        if tail is not None and not follow:
            pod = find()
            for line in logs.tail(self.kube, pod.metadata.name, tail).splitlines():
                on_line(line)
            return True
        reader = logs.LeaderLog(self.kube, name, lambda _, line: on_line(line), self.timings.poll_seconds, find)
        if follow:
            reader.start()
            try:
                while (pod := find()) is not None and pod.status.phase not in ("Succeeded", "Failed"):
                    time.sleep(self.timings.poll_seconds)
            finally:
                reader.stop()
            reader.join(timeout=self.timings.poll_seconds * 4 + 5)
        reader.catch_up()
        return True

    def cleanup(self, pipeline_run_id: str, tell: Tell) -> tuple[list[str], list[str]]:
        """Delete the run's JobSets that are not Completed and its unfinished Jobs (verifier, AOT compiles), each
        with a ``uid`` precondition on the object listed by the run's label."""
        return self._delete_selected(jobset.run_selector(pipeline_run_id))

    def delete_abandoned(self, run_name: str, tell: Tell, pipeline_run_id: str = "") -> tuple[list[str], list[str]]:
        """What carries the run name's label (and ``pipeline_run_id``'s), except workloads whose Lease is still
        renewed (a step of their pipeline run holds them: :mod:`.lease`), and those pipeline runs' Jobs."""
        selector = f"{names.LABEL_RUN_NAME}={run_name}"
        if pipeline_run_id:
            selector += f",{jobset.run_selector(pipeline_run_id)}"
        now = datetime.datetime.now(datetime.UTC)
        live, kept = set(), []
        workloads = [("JobSet", found, jobset.phase) for found in self.kube.list_jobsets(selector)]
        workloads += [("RayJob", found, rayjob.phase) for found in rayjob.list_rayjobs(self.kube, selector)]
        for kind, found, phase_of in workloads:
            meta = found["metadata"]
            if phase_of(found) in ("Completed", "Failed"):
                continue
            if now <= lease.expires(found, lease.get(self.kube, meta["name"])):
                run_id = (meta.get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID, "")
                live.add(run_id)
                kept.append(f"{kind} {meta['name']}: its pipeline run {run_id} still renews its Lease")
        deleted, _ = self._delete_selected(selector, spare=live)
        return deleted, kept

    @contextlib.contextmanager
    def holding(self, name: str, step: str, tell: Tell) -> Iterator[lease.Holder]:
        """Renew the JobSet's Lease while the step waits on it (:class:`.lease.Holder`); the reaper deletes an
        unfinished JobSet whose Lease expired (:func:`.lease.reap`)."""
        with lease.Holder(self.kube, name, f"{step}/{socket.gethostname()}", self.lease_seconds, tell) as held:
            self.holders.append(held)
            yield held

    def delete_matching(self, labels: dict[str, str], tell: Tell) -> list[str]:
        """Delete the JobSets (not Completed) and unfinished Jobs carrying ``labels``, as cleanup does for a run.

        Raises:
            ValueError: ``labels`` has no pipeline run id (only a run's own objects are deleted).
        """
        if not labels.get(names.LABEL_PIPELINE_RUN_ID):
            raise ValueError(f"delete_matching needs the pipeline run id label {names.LABEL_PIPELINE_RUN_ID}")
        deleted, _ = self._delete_selected(",".join(f"{k}={v}" for k, v in sorted(labels.items())))
        for line in deleted:
            tell(f"deleted {line}")
        return deleted

    def _delete_selected(self, selector: str, spare: set[str] = frozenset()) -> tuple[list[str], list[str]]:
        """Delete what ``selector`` lists (JobSets and RayJobs not Completed, claim templates, unfinished Jobs), each
        with a ``uid`` precondition on the object listed: one deleted and recreated by another run between the list
        and the delete is left (409). Objects of the pipeline runs in ``spare`` are left."""
        kube = self.kube
        deleted, kept = [], []

        def spared(obj: dict[str, Any]) -> bool:
            return (obj["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID, "") in spare

        for js in kube.list_jobsets(selector):
            name, state = js["metadata"]["name"], jobset.phase(js)
            if state == "Completed":
                kept.append(name)
                continue
            if not spared(js) and jobset.delete(kube, name, js["metadata"].get("uid")):
                deleted.append(f"JobSet {name} ({state})")
        for found in rayjob.list_rayjobs(kube, selector):
            name, state = found["metadata"]["name"], rayjob.phase(found)
            if state == "Completed":
                kept.append(name)
                continue
            if not spared(found) and rayjob.delete(kube, name, found["metadata"].get("uid")):
                deleted.append(f"RayJob {name} ({state})")
        if not spare:
            deleted += [f"ResourceClaimTemplate {name}" for name in rayjob.delete_claim_templates(kube, selector)]
        found = kube.call(kube.batch.list_namespaced_job, kube.namespace, label_selector=selector, what="list Jobs")
        for job in found.items:
            finished = any(c.type in ("Complete", "Failed") and c.status == "True" for c in job.status.conditions or [])
            owned = any(ref.kind == "JobSet" for ref in job.metadata.owner_references or [])
            if finished or owned or (job.metadata.labels or {}).get(names.LABEL_PIPELINE_RUN_ID, "") in spare:
                continue  # a JobSet's Jobs go with their JobSet
            try:
                kube.call(
                    kube.batch.delete_namespaced_job, job.metadata.name, kube.namespace,
                    body=k8s.V1DeleteOptions(propagation_policy="Foreground",
                                             preconditions=k8s.V1Preconditions(uid=job.metadata.uid)),
                    what=f"delete Job {job.metadata.name}",
                )  # fmt: skip
            except ApiException as error:
                if error.status == 404 or jobset.precondition_failed(error):
                    continue
                raise
            deleted.append(f"Job {job.metadata.name}")
        return deleted, kept

    # -- a stage launched by Ray (a KubeRay RayJob, :mod:`.rayjob`) ----------

    def _ray_wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait for the RayJob's head and every worker pod (slices x hosts) to run; one slice per node pool.

        Fails at once when the RayJob fails, on image pulls and crash loops; on pods Unschedulable past
        ``timings.unschedulable_grace``, quoting their events.
        """
        timings = self.timings
        expected = plan.spec.num_slices * plan.slice.hosts
        started, last_report = time.monotonic(), 0.0
        unschedulable_since: dict[str, float] = {}
        while True:
            found = rayjob.get(self.kube, stage.jobset)
            if found is None:
                raise WorkloadDeleted(f"RayJob {stage.jobset} was deleted before all its pods ran")
            state = rayjob.phase(found)
            if state == "Failed":
                raise LaunchFailed(f"RayJob {stage.jobset} failed before all its pods ran: {rayjob.describe(found)}")
            heads, workers = rayjob.cluster_pods(self.kube, found)
            now = time.monotonic()
            self._check_pods_can_start(plan, heads + workers, unschedulable_since, now)
            running = [p for p in workers if p.status.phase == "Running"]
            head_up = any(p.status.phase == "Running" for p in heads)
            if state == "Completed" or (state == "Running" and head_up and len(running) >= expected):
                break
            if now - last_report >= timings.report_seconds:
                ready = (found.get("status", {}).get("rayClusterStatus") or {}).get("readyWorkerReplicas", 0)
                tell(
                    f"{len(running)}/{expected} Ray worker pods Running, head {'Running' if head_up else 'not yet'}; "
                    f"RayJob {rayjob.describe(found)}; readyWorkerReplicas {ready}; others: "
                    f"{waiting_states(heads + workers, running + [p for p in heads if p.status.phase == 'Running'])}"
                )
                last_report = now
            if now - started > timings.launch_timeout:
                raise LaunchFailed(
                    f"RayJob {stage.jobset}: {len(running)}/{expected} worker pods Running after "
                    f"{timings.launch_timeout:.0f} s; others: {waiting_states(workers, running)}",
                    "check the pods' events (kubectl describe pod); raise timeouts.launch if start-up is slow",
                )
            time.sleep(timings.poll_seconds)
        placement = self._placement(
            running, state, f"RayJob {stage.jobset}",
            "check the worker group's TPU node selectors and that one node pool holds exactly one slice's hosts",
        )  # fmt: skip
        return Running(
            placement=placement,
            node_pools=sorted({str(p.node_pool) for p in placement.values()}),
            note=f"RayCluster {rayjob.cluster_name(found)}: worker group {render_ray.WORKER_GROUP}, "
            f"{plan.spec.num_slices} replicas x {plan.slice.hosts} hosts, and its head",
        )

    def _ray_follow(self, plan: Plan, stage: StagePlan, on_line: Callable[[str], None], tell: Tell) -> Finished:
        """Poll the RayJob and follow its submitter pod's log (the driver's and workers' lines) to the end.

        A retried submitter pod (KubeRay's submitter Job, ``backoffLimit`` 2) does not submit again but runs
        ``ray job logs --follow`` (KubeRay ``common/job.go``, ``BuildJobSubmitCommand``), which prints the Ray job's
        log from its start: the lines already passed on are skipped.

        A worker pod that fails is told, not fatal: Ray Train restarts the worker group inside the driver, up to
        ``FailureConfig(max_failures=max_restarts)``; only the RayJob's own end decides. Restarts are counted from
        the leader's start lines (:data:`.rayjob.LEADER_LINE`).
        """
        timings, name = self.timings, stage.jobset
        leader_starts = 0
        passed: list[str] = []  # every line passed on, in order
        replayed: dict[str, int | None] = {}  # submitter pod -> lines of ``passed`` it has replayed (None: past them)

        def passed_on(pod: str, line: str) -> None:
            nonlocal leader_starts
            if pod not in replayed:
                replayed[pod] = 0 if passed else None
                if passed:
                    tell(f"submitter pod {pod} follows the Ray job's log again from its start (a Job retry)")
            at = replayed[pod]
            if at is not None:  # a retried submitter runs `ray job logs --follow` of the same Ray job: a replay
                if at < len(passed) and passed[at] == line:
                    replayed[pod] = at + 1
                    return
                replayed[pod] = None
            passed.append(line)
            if rayjob.LEADER_LINE.search(line):
                leader_starts += 1
                if leader_starts > 1:
                    count = f"{leader_starts - 1}/{plan.spec.max_restarts}"
                    tell(f"Ray Train restarted the worker group ({count} failures)")
            on_line(line)

        follower = logs.LeaderLog(
            self.kube, name, passed_on, timings.poll_seconds,
            find_pod=lambda: rayjob.submitter(self.kube, name), container=rayjob.SUBMITTER_CONTAINER,
        )  # fmt: skip
        follower.start()
        deadline = time.monotonic() + timings.train_timeout
        failed_pods: set[str] = set()
        suspended_since, final = None, None
        try:
            while time.monotonic() < deadline:
                found = rayjob.get(self.kube, name)
                if found is None:
                    raise WorkloadDeleted(f"RayJob {name} was deleted during training")
                state = rayjob.phase(found)
                if state in ("Completed", "Failed"):
                    final = found
                    break
                if state == "Suspended":
                    if suspended_since is None:
                        suspended_since = time.monotonic()
                        # KubeRay deletes the RayCluster and the submitter Job and, once admitted again, submits
                        # a new Ray job (rayjob_controller.go, Suspending): its log is new, not a replay.
                        passed.clear()
                        found.setdefault("kind", "RayJob")
                        queued = workload.find(self.kube, found)
                        reason = workload.pending_reason(queued, name, plan.spec.queue, "RayJob")
                        tell(f"RayJob suspended by Kueue ({reason}); waiting to be admitted again")
                    elif time.monotonic() - suspended_since > timings.readmit_timeout:
                        raise TrainingFailed(
                            f"RayJob {name} evicted and not admitted again within {timings.readmit_timeout:.0f} s",
                            "free capacity in the ClusterQueue, or raise timeouts.readmit",
                        )
                elif suspended_since is not None:
                    tell(f"RayJob admitted again after {time.monotonic() - suspended_since:.0f} s; training resumes")
                    suspended_since = None
                for pod in rayjob.cluster_pods(self.kube, found)[1]:
                    if pod.status.phase == "Failed" and pod.metadata.name not in failed_pods:
                        failed_pods.add(pod.metadata.name)
                        code = pods.exit_code(pod, rayjob.WORKER_CONTAINER)
                        tell(
                            f"Ray worker pod {pod.metadata.name} (slice {rayjob.slice_of(pod)}, host "
                            f"{rayjob.host_of(pod)}) failed (exit code {code}); KubeRay replaces it "
                            f"and Ray Train retries the worker group (max_failures {plan.spec.max_restarts})"
                        )
                time.sleep(timings.poll_seconds)
        finally:
            follower.stop()
        if final is None:
            raise TrainingFailed(
                f"RayJob {name} still running after {timings.train_timeout:.0f} s",
                "raise timeouts.train if the stage needs longer",
            )
        follower.join(timeout=timings.poll_seconds * 4 + 5)
        follower.catch_up()
        return Finished(
            phase=rayjob.phase(final), restarts=max(0, leader_starts - 1), leader_logs=follower.pods_followed
        )

    def _ray_failure_report(self, found: dict[str, Any]) -> str:
        """The RayJob's status (reason, message), its submitter's last log lines, and each failed worker pod's."""
        name = found["metadata"]["name"]
        lines = [f"RayJob {name} {rayjob.describe(found)}"]
        pod = rayjob.submitter(self.kube, name)
        if pod is not None:
            lines.append(f"submitter pod {pod.metadata.name} (the driver's output); last log lines:")
            lines.append(logs.tail(self.kube, pod.metadata.name, TAIL_LINES, rayjob.SUBMITTER_CONTAINER))
        for pod in rayjob.cluster_pods(self.kube, found)[1]:
            code = pods.exit_code(pod, rayjob.WORKER_CONTAINER)
            if pod.status.phase == "Failed" or code not in (None, 0):
                lines.append(
                    f"Ray worker pod {pod.metadata.name} (slice {rayjob.slice_of(pod)}, host {rayjob.host_of(pod)}) "
                    f"exit code {code}"
                )
        return "\n".join(lines)

    # -- work in the trainer image ------------------------------------------

    def aot_session(self, plan: Plan, cache_dir: str | None, pipeline_run_id: str, tell: Tell) -> CompileSession:
        """One Job of the trainer image per compile, on a CPU node (:mod:`.aot`)."""
        return JobAotSession(self.kube, plan, cache_dir, pipeline_run_id, tell)

    def _stage_job(self, run: Any, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell, fix: str) -> Any:
        """``run`` (:func:`.verifier.run` or :func:`.exporter.run`) for the stage, bounded by the verify timeout, its
        Job labelled with the pipeline run id on the stage's JobSet (the run that trained it; else
        ``pipeline_run_id``), so that a cancel of that run, and only of that run, deletes it.

        Raises:
            VerifierTimeout: not finished within ``timings.verify_timeout`` (the Job was deleted); ``fix`` says
                what to raise.
        """
        js = self.kube.get_jobset(stage.jobset) or {}
        run_id = js.get("metadata", {}).get("labels", {}).get(names.LABEL_PIPELINE_RUN_ID, pipeline_run_id)
        try:
            return run(self.kube, plan, stage, run_id, timeout=self.timings.verify_timeout, on_progress=tell)
        except TimeoutError as error:
            raise VerifierTimeout(f"{error}; the Job was deleted", fix) from None

    def run_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> VerificationReport:
        """The verifier as a Job of the trainer image, labelled with the run id of the stage's JobSet."""
        fix = "raise timeouts.verify if the checkpoint is that large"
        return VerificationReport.model_validate(self._stage_job(verifier.run, plan, stage, pipeline_run_id, tell, fix))

    def run_exporter(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> ExportReport:
        """The exporter as a Job of the trainer image on a CPU node pool (:mod:`.exporter`), labelled with the run id
        of the stage's JobSet, bounded by the verify timeout."""
        fix = "raise timeouts.verify if the export takes that long"
        return ExportReport.model_validate(self._stage_job(exporter.run, plan, stage, pipeline_run_id, tell, fix))
