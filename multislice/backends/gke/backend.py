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
import socket
import time
from collections.abc import Callable, Iterator, Set
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.base import (
    Admission,
    Backend,
    PodExit,
    Tell,
    VerifierTimeout,
    WorkerExit,
)
from multislice.backends.gke import (
    access,
    cluster,
    data_workers,
    export_pool,
    exporter,
    in_place,
    jobset,
    launchers,
    lease,
    logs,
    nodepool,
    pods,
    prerequisites,
    rayjob,
    verifier,
    workload,
)
from multislice.backends.gke import elastic as gke_elastic
from multislice.backends.gke.aot import JobAotSession
from multislice.backends.gke.client import FIELD_MANAGER, Kube
from multislice.config import ClusterSpec
from multislice.plan import Plan, StagePlan
from multislice.preflight import CompileSession
from multislice.reports import ExportReport, ProvisionReport, VerificationReport
from multislice.timings import DEFAULTS, Timings


class GkeBackend(Backend):
    """Acts on a GKE cluster through its Kubernetes API (``kube``) and the GKE API (node pools).

    Args:
        kube: The API client bound to the run's namespace; its ``timings`` are this backend's waits.
    """

    name = "gke"
    hardware = "tpu"
    elastic = True
    launcher_classes = (launchers.JobSetLauncher, launchers.RayJobLauncher)

    def __init__(
        self, kube: Kube, lease_seconds: int = lease.LEASE_SECONDS, run_lease_seconds: int = lease.RUN_LEASE_SECONDS
    ):
        super().__init__(kube.timings)
        self.kube = kube
        self.lease_seconds = lease_seconds  # a JobSet's or RayJob's Lease
        self.run_lease_seconds = run_lease_seconds  # the run Lease (lease.RUN_LEASE_SECONDS)
        self.holders: list[lease.Holder] = []  # the Lease holders of the steps run through this backend
        self.run_holders: list[lease.Holder] = []  # their holders of the run Lease (lease.RunHolder)
        self.following: str | None = None  # the workload last submitted or followed
        self.run_ids: dict[str, str] = {}  # JobSet -> its pipeline run label, kept across an elastic relaunch
        self.cluster: ClusterSpec | None = None  # set by connect(): where node pools are (release_node_pools)
        self.node_pool_client: Any = None  # a container_v1.ClusterManagerClient (None: one with ADC; tests: a fake)

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
        backend = cls(Kube(access.api_client(cluster), namespace, timings or DEFAULTS["gke"], say))
        backend.cluster = cluster
        return backend

    @classmethod
    def where_logs_are(cls, plan: Plan) -> str:
        """``kubectl logs`` of a stage's JobSet pods (the leader: slice 0, host 0)."""
        return (
            f"kubectl logs -n {plan.spec.namespace} -l {names.JOBSET_NAME_KEY}=<jobset> -c {names.TRAINER_CONTAINER} "
            "(cluster logging keeps them after the pods go)"
        )

    # -- capacity ---------------------------------------------------------

    def provision(
        self, plan: Plan, kueue_objects: list[dict[str, Any]], tell: Tell, pipeline_run_id: str = ""
    ) -> ProvisionReport:
        """The prerequisites checked, then TPU node pools (:func:`.nodepool.ensure_node_pools`, those created
        labelled with ``pipeline_run_id``), the Kueue objects applied.

        Before any node pool is asked for: the pipeline's rights for every request the run's steps make
        (:func:`.prerequisites.check_access`, SelfSubjectAccessReviews), the CRDs served, and what each launcher
        needs besides (:meth:`.launchers.GkeLauncher.check_prerequisites`: for Ray, KubeRay v1.7.0's fields in its
        CRDs and the KubeRay TPU webhook or GKE's Ray Operator add-on; with DRANET, Kueue's DeviceClass mapping), and
        that the node pool of the export Jobs can hold them (:func:`.export_pool.check`), and whether the cluster
        accepts in-place restart (:func:`.in_place.check_plan`, dry runs: else Recreate, or a refusal with
        ``restart_strategy: in_place``).
        The LocalQueue is always applied
        (server-side apply, fixed field manager); the cluster-scoped objects only with
        ``service_accounts.kueue_cluster_objects``, else RBAC leaves them to a cluster admin
        (:mod:`multislice.render.rbac`).

        Raises:
            prerequisites.AccessMissing: the pipeline may not make a request the run's steps make.
            cluster.CrdsMissing: JobSet or Kueue (or, for a stage launched by Ray, KubeRay) not installed at the
                needed versions.
            prerequisites.PrerequisiteMissing: for a stage launched by Ray, neither the KubeRay TPU webhook nor the
                Ray Operator add-on; or (:class:`.kuberay.KubeRayTooOld`) KubeRay's CRDs lack a field of the rendered
                RayJob or KubeRay v1.7.0's (an older KubeRay, e.g. that of GKE's add-on).
            cluster.KueueMisconfigured: with DRANET, Kueue's Configuration does not map its DeviceClass to the
                resource the ClusterQueue has quota for (:func:`.cluster.check_kueue_configuration`).
            export_pool.ExportPoolUnfit: the node pool ``exporter.node_selector`` names is missing or cannot hold a
                stage's verify-and-export Job (memory, CPU, boot disk: :func:`.export_pool.check`).
            in_place.InPlaceRestartUnavailable: ``restart_strategy: in_place`` and the cluster refuses it.
            nodepool.NodePoolError: a node pool is missing (unmanaged), mismatched, or its creation failed.
        """
        reviewed = prerequisites.check_access(self.kube, plan)
        tell(f"RBAC: the pipeline may make all {reviewed} requests of this run's steps (SelfSubjectAccessReview)")
        checked = cluster.check_kueue_configuration(self.kube, plan)  # before any node pool is created
        if checked:
            tell(checked)
        runs_with = {type(launcher): launcher for launcher in map(self.launcher_for, plan.stages)}.values()
        crds = cluster.check_crds(self.kube, {k: v for launcher in runs_with for k, v in launcher.crds.items()})
        tell("CRDs served: " + ", ".join(f"{name} {'/'.join(versions)}" for name, versions in crds.items()))
        for launcher in runs_with:
            for line in launcher.check_prerequisites(plan):
                tell(line)
        for line in export_pool.check(plan, self.node_pool_client):  # the export Job's pool, before any pool is made
            tell(line)
        decision = in_place.check_plan(self.kube, plan)  # dry runs only; before any node pool is asked for
        if decision is not None:
            tell(decision.line(plan.spec.restart_strategy))
        self.cluster = self.cluster or plan.spec.cluster
        pools = nodepool.ensure_node_pools(
            plan, self.node_pool_client, on_progress=tell, deadline=time.monotonic() + self.timings.provision_timeout,
            pipeline_run_id=pipeline_run_id,
        )  # fmt: skip
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
            restart_strategy=decision.strategy if decision else None,
            restart_strategy_note=(decision.line(plan.spec.restart_strategy).split(": ", 1)[1] if decision else ""),
        )

    # -- a stage's workload -------------------------------------------------

    def launcher_for(self, stage: StagePlan) -> launchers.GkeLauncher:
        """The stage's launcher (:meth:`.Backend.launcher_for`): one of :attr:`launcher_classes`, each a
        :class:`.launchers.GkeLauncher` (it also reads its object, :meth:`~.launchers.GkeLauncher.get`)."""
        return cast(launchers.GkeLauncher, super().launcher_for(stage))

    def wait_admitted(self, plan: Plan, stage: StagePlan, tell: Tell) -> Admission:
        """Wait for the JobSet's Kueue Workload to be Admitted, telling the pending reason (:mod:`.workload`)."""
        launcher = self.launcher_for(stage)
        admitted, waited = workload.wait_admitted(
            self.kube, stage.workload, plan.spec.queue, timeout=self.timings.admit_timeout, on_progress=tell,
            kind=launcher.workload_kind, get=lambda _, name: launcher.get(name),
        )  # fmt: skip
        where = workload.admission(admitted)
        return Admission(
            cluster_queue=where["cluster_queue"],
            flavors=where["flavors"],
            wait_seconds=round(waited, 2),
            workload=admitted["metadata"]["name"],
        )

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
        old = self.kube.get_jobset(stage.workload)
        labels = (old or {}).get("metadata", {}).get("labels") or {}
        run_id = labels.get(names.LABEL_PIPELINE_RUN_ID) or self.run_ids.get(stage.workload, "manual")
        if old is not None:
            jobset.delete(self.kube, stage.workload)
            jobset.wait_gone(self.kube, stage.workload, self.timings.delete_timeout)
        self.submit(self.workload_manifest(plan, stage, run_id))
        tell(f"JobSet {stage.workload} relaunched on {plan.spec.num_slices} slice(s); waiting for Kueue to admit it")
        admitted = self.wait_admitted(plan, stage, tell)
        tell(f"JobSet {stage.workload} admitted on {plan.spec.num_slices} slice(s) after {admitted.wait_seconds:g} s")

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

    @contextlib.contextmanager
    def holding_run(self, run_name: str, run_dir: str, pipeline_run_id: str, step: str, tell: Tell) -> Iterator[Any]:
        """Renew the run Lease while the step runs (:class:`.lease.RunHolder`); no run id ('', ``manual``):
        nothing is held (a run outside a pipeline has no exit handler to miss)."""
        if not pipeline_run_id or pipeline_run_id == "manual":
            yield None
            return
        holder = f"{step}/{socket.gethostname()}"
        with lease.RunHolder(
            self.kube, pipeline_run_id, run_name, run_dir, holder, self.run_lease_seconds, tell
        ) as held:
            self.run_holders.append(held)
            yield held

    def expired_runs(self, now: Any = None) -> list[dict[str, str]]:
        """The run Leases that expired before ``now`` (:func:`.lease.expired_runs`), as the base class describes."""
        runs = []
        for found in lease.expired_runs(self.kube, now):
            notes = found["metadata"].get("annotations") or {}
            spec = found.get("spec") or {}
            runs.append({
                "pipeline_run_id": notes.get(names.LABEL_PIPELINE_RUN_ID, ""),
                "run_name": notes.get(names.LABEL_RUN_NAME, ""),
                "run_dir": notes.get(lease.ANNOTATION_RUN_DIR, ""),
                "step": str(spec.get("holderIdentity", "")).split("/", 1)[0],
                "expired_at": lease._micro_time(lease.expires({"metadata": {}}, found)),
            })  # fmt: skip
        return [run for run in runs if run["pipeline_run_id"]]

    def end_run(self, pipeline_run_id: str, tell: Tell) -> None:
        """Delete the run Lease (:func:`.lease.run_lease_name`): the exit handler ended the run."""
        lease.delete(self.kube, lease.run_lease_name(pipeline_run_id))

    def claim_notification(self, pipeline_run_id: str, state: str, by: str) -> bool:
        """Create the run's notification tombstone once (:func:`.lease.claim_notification`)."""
        return lease.claim_notification(self.kube, pipeline_run_id, state, by)

    def pool_user(self, pool: str, pipeline_run_id: str) -> str | None:
        """Who other than ``pipeline_run_id`` may use node pool ``pool``: a pod on its nodes of another (or no)
        pipeline run, or, for a pod not yet placed (flex-start capacity pending), any unfinished JobSet or
        RayJob of another pipeline run in the namespace; None when nobody."""
        nodes = self.kube.call(
            self.kube.core.list_node, label_selector=f"cloud.google.com/gke-nodepool={pool}", what="list nodes"
        ).items
        on_pool = {node.metadata.name for node in nodes}
        for pod in self.kube.call(self.kube.core.list_namespaced_pod, self.kube.namespace, what="list pods").items:
            owner = (pod.metadata.labels or {}).get(names.LABEL_PIPELINE_RUN_ID, "")
            done = pod.status is not None and pod.status.phase in ("Succeeded", "Failed")
            node = pod.spec.node_name if pod.spec is not None else None
            if node in on_pool and owner != pipeline_run_id and not done:
                whose = f"pipeline run {owner}" if owner else "no pipeline run"
                return f"pod {pod.metadata.name} of {whose} runs on it"
        workloads = [("JobSet", f, jobset.phase) for f in self.kube.list_jobsets(names.LABEL_PIPELINE_RUN_ID)]
        workloads += [("RayJob", f, rayjob.phase) for f in rayjob.list_rayjobs(self.kube, names.LABEL_PIPELINE_RUN_ID)]
        for kind, found, phase_of in workloads:
            owner = found["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID]
            if owner != pipeline_run_id and phase_of(found) not in ("Completed", "Failed"):
                return f"{kind} {found['metadata']['name']} of pipeline run {owner} is unfinished and may need it"
        return None

    def release_node_pools(self, pipeline_run_id: str, tell: Tell) -> tuple[list[str], list[str]]:
        """Delete the node pools provision created for ``pipeline_run_id`` that nobody else uses
        (:func:`.nodepool.delete_run_pools`, :meth:`pool_user`); ``(deleted, kept)``.

        Without a complete cluster reference (project, location, name) there is no GKE API to ask: nothing.
        """
        cluster = self.cluster
        if cluster is None or not (cluster.project and cluster.location and cluster.name):
            return [], []
        parent = f"projects/{cluster.project}/locations/{cluster.location}/clusters/{cluster.name}"
        client = self.node_pool_client
        if client is None:
            from google.cloud import container_v1  # the GKE API client (2 s to import): only when releasing pools

            client = self.node_pool_client = container_v1.ClusterManagerClient()
        return nodepool.delete_run_pools(
            client, parent, pipeline_run_id, lambda pool: self.pool_user(pool, pipeline_run_id), tell
        )

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

    def _delete_selected(self, selector: str, spare: Set[str] = frozenset()) -> tuple[list[str], list[str]]:
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

    # -- work in the trainer image ------------------------------------------

    def aot_session(self, plan: Plan, cache_dir: str | None, pipeline_run_id: str, tell: Tell) -> CompileSession:
        """One Job of the trainer image per compile, on a CPU node (:mod:`.aot`)."""
        return JobAotSession(self.kube, plan, cache_dir, pipeline_run_id, tell)

    def _stage_job(
        self, run: Any, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell, fix: str, timeout: float = 0
    ) -> Any:
        """``run`` (:func:`.verifier.run`, :func:`.exporter.run_verification` or :func:`.exporter.run`) for the stage,
        bounded by ``timeout`` (at least the verify timeout), its Job labelled with the pipeline run id on the
        stage's JobSet (the run that trained it; else ``pipeline_run_id``), so that a cancel of that run, and only
        of that run, deletes it.

        Raises:
            VerifierTimeout: not finished within the timeout (the Job was deleted); ``fix`` says what to raise.
        """
        js = self.kube.get_jobset(stage.workload) or {}
        run_id = js.get("metadata", {}).get("labels", {}).get(names.LABEL_PIPELINE_RUN_ID, pipeline_run_id)
        try:
            limit = max(self.timings.verify_timeout, timeout)
            return run(self.kube, plan, stage, run_id, timeout=limit, on_progress=tell)
        except TimeoutError as error:
            raise VerifierTimeout(f"{error}; the Job was deleted", fix) from None

    def run_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> VerificationReport:
        """The verifier as a Job of the trainer image, labelled with the run id of the stage's JobSet; for a stage
        with ``export``, the Job that verifies and then exports (:func:`.exporter.run_verification`), left running
        for the export step once its log has the verification."""
        fix = "raise timeouts.verify if the checkpoint is that large"
        run = exporter.run_verification if stage.export else verifier.run
        return VerificationReport.model_validate(self._stage_job(run, plan, stage, pipeline_run_id, tell, fix))

    def run_data_workers(
        self, plan: Plan, stage: StagePlan, request: dict[str, Any], pipeline_run_id: str, tell: Tell
    ) -> list[WorkerExit]:
        """prepare_data's shard workers as one Indexed Job of the trainer image (:mod:`.data_workers`), labelled with
        ``pipeline_run_id`` (a cancel of the run deletes it: :meth:`delete_matching`), bounded by
        ``timings.prepare_data_timeout``."""
        return data_workers.run(
            self.kube, plan, stage, request, pipeline_run_id, timeout=self.timings.prepare_data_timeout, tell=tell
        )

    def run_exporter(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> ExportReport:
        """The verify step's verify-and-export Job on a CPU node pool (:mod:`.exporter`), adopted and read to its end
        (created when it is gone), labelled with the run id of the stage's JobSet, bounded by the verify timeout plus
        the export's own time from the model's size (:func:`.exporter.export_seconds`)."""
        fix = "raise timeouts.verify if the export takes that long"
        limit = self.timings.verify_timeout + exporter.export_seconds(plan, stage)
        job = self._stage_job(exporter.run, plan, stage, pipeline_run_id, tell, fix, limit)
        return ExportReport.model_validate(job)
