"""The GKE backend's launchers (:mod:`multislice.backends.launcher`): a stage as a JobSet, or as a KubeRay RayJob.

Both share what a pod that cannot start looks like (:class:`GkeLauncher`: image pulls, crash loops, Unschedulable
past ``timings.unschedulable_grace``, flex-start's capacity wait) and the one-slice-per-node-pool placement check;
each reads its own object's state (:mod:`.jobset`, :mod:`.rayjob`: the upstream fields read are named there) and
follows its own log: the JobSet's leader pod across restarts, the RayJob's submitter pod (the driver's output).
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.base import (
    Finished,
    LaunchFailed,
    Running,
    Submission,
    Tell,
    TrainingFailed,
    WorkloadDeleted,
)
from multislice.backends.gke import (
    in_place,
    jobset,
    kuberay,
    logs,
    nodepool,
    pods,
    prerequisites,
    rayjob,
    watch,
    workload,
)
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION
from multislice.backends.launcher import Launcher
from multislice.plan import Plan, StagePlan
from multislice.render import in_place as render_in_place
from multislice.render import jobset as jobset_render
from multislice.render import launchers
from multislice.render import ray as render_ray
from multislice.reports import PodPlacement

if TYPE_CHECKING:
    from multislice.backends.gke.backend import GkeBackend

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


class GkeLauncher(Launcher):
    """A launcher on a GKE cluster: the backend's API client and waits, and the checks every workload's pods share.

    Args:
        backend: The backend it launches for (its ``kube`` and ``timings``; the JobSet launcher also keeps the
            backend's elastic bookkeeping, ``following`` and ``run_ids``).
    """

    def __init__(self, backend: GkeBackend):
        self.backend = backend
        self.kube = backend.kube
        self.timings = backend.timings

    def render(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's TPU workload (:meth:`multislice.render.launchers.LauncherKind.render`)."""
        return self.kind.render(plan, stage, "tpu", pipeline_run_id)

    @abc.abstractmethod
    def get(self, name: str) -> dict[str, Any] | None:
        """The workload object as stored, or None when it does not exist."""

    def check_prerequisites(self, plan: Plan) -> list[str]:
        """Check what this launcher needs on the cluster besides its CRDs, before provision creates node pools;
        one line per finding (none by default).

        Raises:
            multislice.backends.gke.prerequisites.PrerequisiteMissing: something is missing; the fix says how to
                install it.
        """
        return []

    def phase(self, name: str) -> str | None:
        """The workload's phase, or None when it does not exist."""
        found = self.get(name)
        return None if found is None else self.phase_of(found)

    @staticmethod
    @abc.abstractmethod
    def phase_of(obj: dict[str, Any]) -> str:
        """The phase of a workload object as stored: ``Completed``, ``Failed``, ``Suspended`` or ``Running``."""

    def _pod_line(self, pod: Any, cause: str) -> str:
        events = pods.events(self.kube, pod.metadata.name)
        return f"pod {pod.metadata.name} (slice {pods.slice_index(pod)}, host {pods.host_index(pod)}) {cause}" + (
            f"; its events:\n{events}" if events else ""
        )

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

    def _check_launch_deadline(
        self, what: str, counted: str, pods_: list[Any], running: list[Any], expected: int, started: float, now: float
    ) -> None:
        """Raise :class:`LaunchFailed` once ``timings.launch_timeout`` seconds have passed since ``started`` (both
        :func:`time.monotonic`) without ``expected`` of the ``counted`` pods running; ``pods_``: those pods, whose
        other states the message lists."""
        timeout = self.timings.launch_timeout
        if now - started > timeout:
            raise LaunchFailed(
                f"{what}: {len(running)}/{expected} {counted} Running after {timeout:.0f} s; "
                f"others: {waiting_states(pods_, running)}",
                "check the pods' events (kubectl describe pod); raise timeouts.launch if start-up is slow",
            )

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
                agent = problem.startswith(f"container {render_in_place.AGENT_CONTAINER}:")
                image = plan.spec.images.in_place_restart_agent if agent else plan.spec.images.trainer
                raise LaunchFailed(
                    self._pod_line(pod, f"cannot start: {problem}"),
                    f"check the image reference {image!r} and that the nodes may pull it "
                    "(Artifact Registry reader role for the node service account)"
                    + (
                        "; JobSet's in-place restart agent is built from kubernetes-sigs/jobset v0.12.0 "
                        "(make image-agent; docs/gke-setup.md), or set restart_strategy: recreate"
                        if agent
                        else ""
                    ),
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


class JobSetLauncher(GkeLauncher):
    """A stage as a multislice JobSet (:mod:`.jobset`): the default launcher, and the elastic one."""

    kind = launchers.KINDS["jobset"]
    workload_kind = "JobSet"

    def render(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's TPU JobSet, restarting as provision found the cluster accepts (:func:`.in_place.chosen`: the
        provision report in the run directory)."""
        return jobset_render.render_jobset(
            plan, stage, hardware="tpu", pipeline_run_id=pipeline_run_id, restart_strategy=in_place.chosen(plan)
        )

    def get(self, name: str) -> dict[str, Any] | None:
        """The JobSet, or None."""
        return self.kube.get_jobset(name)

    phase_of = staticmethod(jobset.phase)

    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the JobSet with its spec-hash annotation, adopt it when the hash matches, or replace a finished one
        of another pipeline run (:func:`.jobset.create_or_adopt`)."""
        replaced: list[str] = []
        self.backend.following = manifest["metadata"]["name"]
        created, adopted = jobset.create_or_adopt(self.kube, manifest, replaced)
        return _submission(manifest, created, adopted, replaced)

    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait for every pod of the current attempt to run; check one slice per node pool.

        Event-driven: woken by watch events of the JobSet's pods (each wake reads the JobSet and lists its pods), and
        at least every ``min(watch_seconds, report_seconds, unschedulable_grace)`` for the clock's checks.

        Fails at once on image pulls and crash loops; on pods Unschedulable past
        ``timings.unschedulable_grace``, quoting their events.
        """
        timings = self.timings
        expected = self.expected_pods(plan)
        started = time.monotonic()
        unschedulable_since: dict[str, float] = {}
        last_report = 0.0
        # Woken by the watch of the JobSet's pods (list, then watch from its resourceVersion, :func:`.watch.follow`):
        # each pod change, and each idle end (the clock's checks: Unschedulable grace, reports, the deadline).
        changes = watch.follow(
            self.kube, self.kube.core.list_namespaced_pod, self.kube.namespace,
            label_selector=f"{names.JOBSET_NAME_KEY}={stage.workload}", what=f"pods of JobSet {stage.workload}",
            deadline=started + timings.launch_timeout + timings.watch_seconds, listed_marker=True,
            watch_seconds=min(timings.watch_seconds, timings.report_seconds, timings.unschedulable_grace),
        )  # fmt: skip
        state, running = "Pending", []
        for change, obj in changes:
            if change == watch.LISTED and obj is not None:
                continue  # one look per list, after its last item
            js = self.kube.get_jobset(stage.workload)
            if js is None:
                raise WorkloadDeleted(f"JobSet {stage.workload} was deleted before all its pods ran")
            state = jobset.phase(js)
            if state == "Failed":
                raise LaunchFailed(f"JobSet {stage.workload} failed before all its pods ran: {jobset.describe(js)}")
            current = pods.list_pods(self.kube, stage.workload, jobset.restarts(js))
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
            self._check_launch_deadline(f"JobSet {stage.workload}", "pods", current, running, expected, started, now)
        else:
            raise LaunchFailed(
                f"JobSet {stage.workload}: {len(running)}/{expected} pods Running after {timings.launch_timeout:.0f} s",
                "check the pods' events (kubectl describe pod); raise timeouts.launch if start-up is slow",
            )
        placement = self._placement(
            running, state, f"JobSet {stage.workload}",
            "check the JobSet's exclusive-topology annotation and that JobSet's webhook is installed",
        )  # fmt: skip
        return Running(placement=placement, node_pools=sorted({str(p.node_pool) for p in placement.values()}))

    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Watch the JobSet (re-listing after 410 Gone) and follow its leader's log across restarts: a JobSet
        restart's new leader pod, or, under ``InPlaceRestart``, the same leader pod's new container (the stream of
        the old one ends, :class:`.logs.LeaderLog` reads the pod again from its last line's time). Restarts counted
        are ``status.restarts`` plus the in-place ones (:func:`.jobset.in_place_restarts`).

        Tells restarts and Kueue evictions (the JobSet suspended again) while it
        waits to be admitted again, up to ``timings.readmit_timeout``.
        """
        timings = self.timings
        self.backend.following = stage.workload
        follower = logs.LeaderLog(self.kube, stage.workload, lambda pod, line: on_line(line), timings.poll_seconds)
        follower.start()
        started = time.monotonic()
        seen_restarts, seen_in_place, suspended_since, final = 0, 0, None, None
        causes: list[str] = []
        try:
            # An elastic stage's lost slice shows in pods and nodes, not in the JobSet: each watch request then
            # lasts at most poll_seconds, and ``interrupt`` is asked after each event and each idle end.
            events = watch.follow(
                self.kube, self.kube.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION,
                self.kube.namespace, JOBSET_PLURAL, field_selector=f"metadata.name={stage.workload}",
                what=f"JobSet {stage.workload}", deadline=started + timings.train_timeout, on_relist=tell,
                watch_seconds=None if interrupt is None else max(1.0, timings.poll_seconds),
            )  # fmt: skip
            for kind, js in events:
                if kind == watch.IDLE:
                    js = self.kube.get_jobset(stage.workload)
                    if js is None:
                        kind = "DELETED"
                if kind == "DELETED" or js is None:
                    raise WorkloadDeleted(f"JobSet {stage.workload} was deleted during training")
                state = jobset.phase(js)
                if jobset.restarts(js) != seen_restarts:
                    causes += [
                        pods.attempt_failure(self.kube, stage.workload, a)
                        for a in range(seen_restarts, jobset.restarts(js))
                    ]
                    seen_restarts = jobset.restarts(js)
                    count = f"{seen_restarts}/{plan.spec.max_restarts}"
                    tell(f"JobSet restarted ({count} restarts); following the new leader")
                    tell(f"restart {seen_restarts} cause: {causes[-1]}")
                if jobset.in_place_restarts(js) > seen_in_place:  # InPlaceRestart: same pods, new containers
                    seen_in_place = jobset.in_place_restarts(js)
                    causes.append(pods.in_place_failure(self.kube, stage.workload))
                    count = f"{seen_restarts + seen_in_place}/{plan.spec.max_restarts}"
                    tell(f"JobSet restarted in place ({count} restarts, attempt {seen_in_place}); following the "
                         "leader's new container")  # fmt: skip
                    tell(f"in-place restart {seen_in_place} cause: {causes[-1]}")
                if state == "Suspended":
                    if suspended_since is None:
                        suspended_since = time.monotonic()
                        found = workload.find(self.kube, js)
                        reason = workload.pending_reason(found, stage.workload, plan.spec.queue)
                        tell(f"JobSet suspended by Kueue ({reason}); waiting to be admitted again")
                    elif time.monotonic() - suspended_since > timings.readmit_timeout:
                        raise TrainingFailed(
                            f"JobSet {stage.workload} evicted and not admitted again within "
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
                        self.backend.run_ids[stage.workload] = labels[names.LABEL_PIPELINE_RUN_ID]
                    jobset.delete(self.kube, stage.workload)
                    jobset.wait_gone(self.kube, stage.workload, timings.delete_timeout)
                    follower.stop()
                    follower.join(timeout=timings.poll_seconds * 4 + 5)
                    follower.catch_up()
                    return Finished(
                        phase="Interrupted",
                        restarts=jobset.restarts(js) + jobset.in_place_restarts(js),
                        leader_logs=follower.pods_followed,
                        restart_causes=causes,
                    )
        finally:
            follower.stop()
        if final is None:
            raise TrainingFailed(
                f"JobSet {stage.workload} still running after {timings.train_timeout:.0f} s",
                "raise timeouts.train if the stage needs longer",
            )
        follower.join(timeout=timings.poll_seconds * 4 + 5)
        follower.catch_up()
        for attempt in range(seen_restarts, jobset.restarts(final)):  # restarts the watch did not see one by one
            causes.append(pods.attempt_failure(self.kube, stage.workload, attempt))
        if jobset.in_place_restarts(final) > seen_in_place:
            causes.append(pods.in_place_failure(self.kube, stage.workload))
        return Finished(phase=jobset.phase(final), restarts=jobset.restarts(final) + jobset.in_place_restarts(final),
                        leader_logs=follower.pods_followed, restart_causes=causes)  # fmt: skip

    def failure_report(self, name: str) -> str:
        """The JobSet's conditions and restarts, then each failed pod's exit code and last log lines."""
        js = self.kube.get_jobset(name)
        if js is None:
            return f"JobSet {name} does not exist"
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

    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Delete the JobSet with foreground propagation (its Jobs and pods go first). Returns once the API server
        accepted the deletion; the kubelets stop the pods after that.

        With ``owner`` (a pipeline run id): only when the JobSet's ``pipeline/runid`` label is ``owner``, deleted
        with a ``uid`` precondition on the object read, so one another run created meanwhile is left. With
        ``grace_seconds``, its pods (those of ``owner`` only) are deleted too with that ``gracePeriodSeconds``
        (core v1 ``DeleteOptions``), overriding their ``terminationGracePeriodSeconds``.
        """
        found = self.kube.get_jobset(name)
        if found is None or (owner is not None and not _owned(found, owner)):
            return False
        gone = jobset.delete(self.kube, name, found["metadata"].get("uid") if owner is not None else None)
        if gone and grace_seconds is not None:
            self._delete_pods(name, owner, grace_seconds)
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


class RayJobLauncher(GkeLauncher):
    """A stage as a KubeRay RayJob (:mod:`.rayjob`) with its DRANET claim templates."""

    kind = launchers.KINDS["ray"]
    workload_kind = "RayJob"
    #: KubeRay's RayJob and the RayCluster it creates (``ray.io/v1``, KubeRay v1.7.0).
    crds = {
        f"{rayjob.RAYJOB_PLURAL}.{rayjob.RAY_GROUP}": rayjob.RAY_VERSION,
        kuberay.RAYCLUSTERS_CRD: kuberay.SERVED_VERSION,
    }

    def check_prerequisites(self, plan: Plan) -> list[str]:
        """KubeRay v1.7.0's fields in the cluster's CRDs, walked with each Ray stage's rendered RayJob
        (:func:`.kuberay.check_kuberay`: GKE's Ray Operator add-on may run an older KubeRay), then the KubeRay TPU
        webhook, or GKE's Ray Operator add-on (:func:`.prerequisites.check_tpu_webhook`).

        Raises:
            multislice.backends.gke.kuberay.KubeRayTooOld: the CRDs lack a field the RayJob renders or KubeRay
                v1.7.0's.
            multislice.backends.gke.prerequisites.PrerequisiteMissing: neither the webhook nor the add-on.
            multislice.backends.gke.nodepool.NodePoolError: the GKE API refused to read the cluster.
        """
        rendered = {
            stage.name: self.kind.render(plan, stage, "tpu", "")  # the run id only labels: no field of its own
            for stage in plan.stages
            if launchers.kind_of(stage).name == self.kind.name
        }
        return [
            kuberay.check_kuberay(self.kube, rendered),
            prerequisites.check_tpu_webhook(self.kube, plan, lambda p: nodepool.ray_operator_enabled(p)),
        ]

    def __init__(self, backend: GkeBackend):
        super().__init__(backend)
        self.claims: dict[str, list[dict[str, Any]]] = {}  # RayJob name -> its DRANET claim templates

    def render(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's RayJob; its DRANET ResourceClaimTemplates (with additional node networks) are rendered with it
        and created by :meth:`submit` before the RayJob."""
        manifest = self.kind.render(plan, stage, "tpu", pipeline_run_id)
        self.claims[manifest["metadata"]["name"]] = self.kind.companions(plan, stage, pipeline_run_id)
        return manifest

    def get(self, name: str) -> dict[str, Any] | None:
        """The RayJob, or None (also when KubeRay is absent: :data:`.rayjob.NO_RAY`)."""
        return rayjob.get(self.kube, name)

    phase_of = staticmethod(rayjob.phase)

    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the RayJob's claim templates (its worker pods cannot be created without them), then the RayJob with
        its spec-hash annotation; adopt or replace as :func:`.rayjob.create_or_adopt` does."""
        replaced: list[str] = []
        self.backend.following = manifest["metadata"]["name"]
        for template in self.claims.get(manifest["metadata"]["name"], []):
            rayjob.apply_claim_template(self.kube, template)
        created, adopted = rayjob.create_or_adopt(self.kube, manifest, replaced)
        return _submission(manifest, created, adopted, replaced)

    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait for the RayJob's head and every worker pod (slices x hosts) to run; one slice per node pool.

        Fails at once when the RayJob fails, on image pulls and crash loops; on pods Unschedulable past
        ``timings.unschedulable_grace``, quoting their events.
        """
        timings = self.timings
        expected = self.expected_pods(plan)
        started, last_report = time.monotonic(), 0.0
        unschedulable_since: dict[str, float] = {}
        while True:
            found = rayjob.get(self.kube, stage.workload)
            if found is None:
                raise WorkloadDeleted(f"RayJob {stage.workload} was deleted before all its pods ran")
            state = rayjob.phase(found)
            if state == "Failed":
                raise LaunchFailed(f"RayJob {stage.workload} failed before all its pods ran: {rayjob.describe(found)}")
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
            self._check_launch_deadline(
                f"RayJob {stage.workload}", "worker pods", workers, running, expected, started, now
            )
            time.sleep(timings.poll_seconds)
        placement = self._placement(
            running, state, f"RayJob {stage.workload}",
            "check the worker group's TPU node selectors and that one node pool holds exactly one slice's hosts",
        )  # fmt: skip
        return Running(
            placement=placement,
            node_pools=sorted({str(p.node_pool) for p in placement.values()}),
            note=f"RayCluster {rayjob.cluster_name(found)}: worker group {render_ray.WORKER_GROUP}, "
            f"{plan.spec.num_slices} replicas x {plan.slice.hosts} hosts, and its head",
        )

    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Watch the RayJob (re-listing after 410 Gone) and follow its submitter pod's log (the driver's and workers'
        lines) to the end.

        A retried submitter pod (KubeRay's submitter Job, ``backoffLimit`` 2) does not submit again but runs
        ``ray job logs --follow`` (KubeRay ``common/job.go``, ``BuildJobSubmitCommand``), which prints the Ray job's
        log from its start: the lines already passed on are skipped.

        A worker pod that fails is told, not fatal: Ray Train restarts the worker group inside the driver, up to
        ``FailureConfig(max_failures=max_restarts)``; only the RayJob's own end decides. Restarts are counted from
        the leader's start lines (:data:`.rayjob.LEADER_LINE`).
        """
        timings, name = self.timings, stage.workload
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
        # Woken by watch events of the RayJob (KubeRay mirrors its RayCluster's and Ray job's state into its status),
        # and at least every ``watch_seconds`` for the clock's checks and its worker pods' failures (told, not fatal).
        changes = watch.follow(
            self.kube, self.kube.custom.list_namespaced_custom_object, rayjob.RAY_GROUP, rayjob.RAY_VERSION,
            self.kube.namespace, rayjob.RAYJOB_PLURAL, field_selector=f"metadata.name={name}", what=f"RayJob {name}",
            deadline=deadline, on_relist=tell, listed_marker=True,
        )  # fmt: skip
        try:
            for change, obj in changes:
                if change == watch.LISTED and obj is not None:
                    continue  # one look per list, after its last item
                found = obj if change in ("ADDED", "MODIFIED") else rayjob.get(self.kube, name)
                if change == "DELETED" or found is None:
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

    def failure_report(self, name: str) -> str:
        """The RayJob's status (reason, message), its submitter's last log lines, and each failed worker pod's."""
        found = rayjob.get(self.kube, name)
        if found is None:
            return f"RayJob {name} does not exist"
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

    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Delete the RayJob (foreground: its RayCluster and submitter Job go first) and its claim templates.

        With ``owner``: only when its ``pipeline/runid`` label is ``owner``, with a ``uid`` precondition on the object
        read. ``grace_seconds`` is not applied: KubeRay's finalizer stops the Ray job first (:func:`.rayjob.delete`).
        """
        found = rayjob.get(self.kube, name)
        if found is None or (owner is not None and not _owned(found, owner)):
            return False
        gone = rayjob.delete(self.kube, name, found["metadata"].get("uid") if owner is not None else None)
        labels = found["metadata"].get("labels") or {}
        keys = (names.LABEL_PIPELINE_RUN_ID, names.LABEL_STAGE)
        if all(labels.get(key) for key in keys):
            rayjob.delete_claim_templates(self.kube, ",".join(f"{key}={labels[key]}" for key in keys))
        return gone


def _submission(manifest: dict[str, Any], created: dict[str, Any], adopted: bool, replaced: list[str]) -> Submission:
    return Submission(
        name=manifest["metadata"]["name"],
        adopted=adopted,
        uid=created["metadata"].get("uid"),
        replaced=replaced[-1] if replaced else None,
    )
