"""The backend interface: everything that differs between where a run's workloads run.

In the spirit of kubeflow/sdk's ``RuntimeBackend``
(``kubeflow/trainer/backends/base.py``): one abstract class, one
implementation per place, and steps that never ask which one they have.
:class:`~multislice.backends.local.LocalBackend` runs each pod of a JobSet as a
process of this machine; :class:`~multislice.backends.gke.GkeBackend` acts on a
GKE cluster through the Kubernetes API (JobSet, Kueue) and the GKE API (node
pools). A step (:mod:`multislice.steps`) renders what is common, calls these
methods, and builds its report from what they return.

A workload is what trains one stage: a JobSet or a KubeRay RayJob, each launched by one of the backend's
launchers (:mod:`multislice.backends.launcher`, a second axis in the style of kubeflow/sdk's container adapters).
The backend looks a stage's launcher up once (:meth:`Backend.launcher_for`) and delegates to it:
:meth:`workload_manifest`, :meth:`submit`, :meth:`wait_running`, :meth:`follow`, :meth:`failure_report`,
:meth:`delete`, :meth:`workload_phase`. An elastic resize (the same stage relaunched on fewer slices) is another
manifest through the same methods.

Every wait takes its limits from :attr:`Backend.timings`
(:mod:`multislice.timings`), the same values the compiled pipeline's pod
deadlines come from. Every method that waits reports progress through a
``tell`` callback (one line each), so the step decides how lines look.
Run storage is the same for every backend: :mod:`multislice.storage`
(``etils.epath``, local paths and ``gs://``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from multislice import cancel, names
from multislice.errors import InputError, RunFailed
from multislice.plan import Plan, StagePlan
from multislice.preflight import CompileSession
from multislice.render import jobset, launchers
from multislice.reports import ExportReport, PodPlacement, ProvisionReport, VerificationReport
from multislice.timings import Timings

if TYPE_CHECKING:
    from multislice.backends.launcher import Launcher

#: A progress callback: one human-readable line.
Tell = Callable[[str], None]


class LaunchFailed(RunFailed):
    """A stage's pods did not all start: the workload ended first, a pod cannot pull its image or
    crash-loops, a pod stayed Unschedulable, or placement is not one slice per node pool."""


class TrainingFailed(RunFailed):
    """A stage's training failed, was cancelled or its workload was deleted; the message has the
    reason, each failed pod's exit code and its last log lines."""


class AdmissionTimeout(RunFailed):
    """Kueue did not admit a stage's workload in time; the message has the last pending reason."""


class AdmissionBlocked(AdmissionTimeout):
    """Kueue cannot admit a stage's workload until its configuration changes (a missing LocalQueue,
    ClusterQueue or WorkloadPriorityClass, a resource no flavor covers): admit fails at once with the cause
    and fix instead of waiting out ``timings.admit_timeout``."""


class WorkloadConflict(InputError):
    """A workload of that name exists with another spec (another run): nothing was changed."""


class LauncherUnsupported(InputError):
    """A stage's launcher is one this backend cannot launch (``launcher: ray`` on a TPU backend without RayJobs)."""


class WorkloadDeleted(RunFailed):
    """A stage's workload was deleted (by a user, or another run's cleanup) while a step waited on it."""


class VerifierTimeout(RunFailed):
    """The checkpoint verifier ran past ``timings.verify_timeout``; it was stopped."""


@dataclass(frozen=True)
class Submission:
    """What :meth:`Backend.submit` did.

    Attributes:
        name: The workload's name.
        adopted: The workload existed with the same spec (a retried step) and was taken over, not created.
        uid: Its API uid (GKE), or None.
        replaced: The pipeline run id of a finished workload of the same name (an earlier run this one
            continues) that was deleted and created anew for this run; None when there was none.
    """

    name: str
    adopted: bool
    uid: str | None = None
    replaced: str | None = None


@dataclass(frozen=True)
class Admission:
    """A workload's admission by Kueue (or, on the local backend, by nothing: at once).

    Attributes:
        cluster_queue: The ClusterQueue that admitted it.
        flavors: ResourceFlavors assigned.
        wait_seconds: From the start of the wait to admission.
        workload: The Kueue Workload's name (GKE).
        note: What this backend does and does not do at admission.
    """

    cluster_queue: str | None
    flavors: list[str]
    wait_seconds: float
    workload: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Running:
    """Every pod of a workload running: pod name -> placement, the node pools it spans, and a note."""

    placement: dict[str, PodPlacement]
    node_pools: list[str] = field(default_factory=list)
    note: str = ""


@dataclass(frozen=True)
class Finished:
    """How a followed workload ended.

    Attributes:
        phase: ``Completed`` or ``Failed``.
        restarts: JobSet restarts during training.
        leader_logs: What was followed: each attempt's leader log (files locally, pod names on GKE).
        restart_causes: Why each restart happened, in order (the failed pod, its exit code and reason), one per
            restart where the backend could read it.
    """

    phase: str
    restarts: int
    leader_logs: list[str]
    restart_causes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PodExit:
    """How one pod (host) of a workload's latest attempt ended, as the kubelet or the local supervisor saw it.

    Attributes:
        slice_index: The pod's slice (child Job index).
        host: The pod's host within its slice (completion index).
        exit_code: The container's exit code (128 + signal for a signal), or None while it runs.
        finished_at: When it ended, Unix seconds (None when unknown).
    """

    slice_index: int
    host: int
    exit_code: int | None
    finished_at: float | None = None


class DataWorkersFailed(RunFailed):
    """A shard worker of prepare_data failed (its exit status and last output lines), or they ran past
    ``timings.prepare_data_timeout``; the workers still running were stopped."""


@dataclass(frozen=True)
class WorkerExit:
    """How one shard worker of prepare_data ended (:meth:`Backend.run_data_workers`).

    Attributes:
        index: Its range (the Indexed Job's completion index).
        exit_code: The process's or container's exit status (None when unknown).
        seconds: How long it ran, seconds (None when unknown).
        max_rss_bytes: Its peak resident memory, bytes (locally from ``wait4``'s ``ru_maxrss``; None on GKE).
        pod: The pod that ran it (GKE), or None.
    """

    index: int
    exit_code: int | None
    seconds: float | None = None
    max_rss_bytes: int | None = None
    pod: str | None = None


class Backend(abc.ABC):
    """Where a run's workloads run. Subclasses: ``local`` and ``gke``.

    Attributes:
        name: ``local`` or ``gke`` (the run spec's ``backend``).
        hardware: The pod variant its workloads are rendered for: ``cpu`` or ``tpu``.
        timings: The waits (:func:`multislice.timings.timings_for`).
    """

    name: ClassVar[str]
    hardware: ClassVar[jobset.Hardware]
    #: Whether the backend implements elastic training (:meth:`available_slices`, :meth:`lost_slice`, ``interrupt``).
    elastic: ClassVar[bool] = False
    #: The backend's launchers, one per kind of workload it launches, each built with the backend
    #: (:mod:`multislice.backends.launcher`); a name-only call (:meth:`delete`) asks them in this order.
    launcher_classes: ClassVar[tuple[Callable[[Any], Launcher], ...]] = ()

    def __init__(self, timings: Timings):
        self.timings = timings

    @classmethod
    @abc.abstractmethod
    def where_logs_are(cls, plan: Plan) -> str:
        """Where a user reads the pods' logs of a run on this backend (one line)."""

    # -- capacity ---------------------------------------------------------

    @abc.abstractmethod
    def provision(
        self, plan: Plan, kueue_objects: list[dict[str, Any]], tell: Tell, pipeline_run_id: str = ""
    ) -> ProvisionReport:
        """Make sure capacity (node pools) and the queueing objects (validated ``kueue_objects``) exist.

        ``pipeline_run_id``: the pipeline run node pools created now are for (GKE: labelled with it, so a
        terminated run's are deleted, :meth:`release_node_pools`).

        Raises:
            multislice.errors.UserError: capacity is missing or mismatched (the message says what to change).
        """

    # -- a stage's workload -------------------------------------------------

    @functools.cached_property
    def launchers(self) -> list[Launcher]:
        """One instance of each of :attr:`launcher_classes`, built on first use."""
        return [make(self) for make in self.launcher_classes]

    def launcher_for(self, stage: StagePlan) -> Launcher:
        """The launcher of ``stage``: the one whose kind is the stage's (:func:`multislice.render.launchers.kind_of`).

        Raises:
            LauncherUnsupported: this backend has no launcher of that kind (a RayJob on a TPU backend without one).
        """
        kind = launchers.kind_of(stage)
        for launcher in self.launchers:
            if launcher.kind is kind:
                return launcher
        default = next(iter(launchers.KINDS))
        raise LauncherUnsupported(
            f"stage {stage.name} has launcher {kind.name}, and the {self.name} backend does not launch {kind.kind}s",
            f"set launcher: {default} for this backend (or --set launcher={default}); `multislice render --set "
            f"launcher={kind.name}` writes the {kind.kind} to apply yourself",
        )

    def launcher_of(self, name: str) -> Launcher | None:
        """The launcher whose workload ``name`` exists (the first of :attr:`launchers` that has it), or None."""
        return next((launcher for launcher in self.launchers if launcher.phase(name) is not None), None)

    def workload_manifest(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The workload that trains ``stage`` on this backend: what its launcher renders (a JobSet for this
        backend's hardware; with ``launcher: ray`` a RayJob on GKE, the Ray driver's one-pod JobSet locally).

        Raises:
            ValueError: ``pipeline_run_id`` is not a valid label value.
            LauncherUnsupported: this backend has no launcher for the stage's.
        """
        return self.launcher_for(stage).render(plan, stage, pipeline_run_id)

    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the workload, adopt an existing one of the same name and spec (a retried step), or replace a
        finished one of another pipeline run (a run that continues an earlier one): by the launcher of the
        manifest's kind.

        Raises:
            multislice.render.schema.ManifestInvalid: it fails CRD validation.
            WorkloadConflict: the name is taken by another spec.
            LauncherUnsupported: no launcher of this backend creates that kind.
        """
        kind = manifest.get("kind")
        for launcher in self.launchers:
            if launcher.workload_kind == kind:
                return launcher.submit(manifest)
        raise LauncherUnsupported(
            f"the {self.name} backend does not launch {kind} objects", "render it for this backend"
        )

    @abc.abstractmethod
    def wait_admitted(self, plan: Plan, stage: StagePlan, tell: Tell) -> Admission:
        """Wait until the stage's workload is admitted (``timings.admit_timeout``).

        Raises:
            AdmissionTimeout: not admitted in time (the message has the last pending reason).
            WorkloadDeleted: the workload was deleted while waiting.
        """

    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait until every pod of every slice runs (``timings.launch_timeout``); where they run (the stage's launcher).

        Raises:
            LaunchFailed: they cannot all start (the message quotes the pods' state and events), or not all
                run within ``timings.launch_timeout``.
            WorkloadDeleted: the workload was deleted while waiting.
        """
        return self.launcher_for(stage).wait_running(plan, stage, tell)

    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Follow the stage's workload to its end (``timings.train_timeout``).

        Calls ``on_line`` with each line of the leader's log (slice 0, host 0),
        across restart attempts and in order, and ``tell`` with what happens to
        the workload (restarts, evictions). ``interrupt`` (backends with
        :attr:`elastic`) is asked after each poll; when it returns True the
        workload is deleted, the lines its leader logged until then are passed
        on, and following stops with phase ``Interrupted``.

        Raises:
            TrainingFailed: not admitted again after an eviction in time, or still running after
                ``timings.train_timeout``.
            WorkloadDeleted: the workload was deleted during training.
        """
        return self.launcher_for(stage).follow(plan, stage, on_line, tell, interrupt)

    def available_slices(self, plan: Plan) -> int | None:
        """Slices whose capacity is available now (elastic training); None when the backend does not know."""
        return None

    def lost_slice(self, name: str) -> str | None:
        """Why workload ``name`` lost a slice and waits for its capacity (elastic training), or None when it has not."""
        return None

    def relaunch(self, plan: Plan, stage: StagePlan, tell: Tell) -> None:
        """Replace the stage's workload by one for ``plan``'s ``num_slices`` (an elastic resize), same name and labels.

        ``plan`` and ``stage`` are the stage on its new slice count (:meth:`multislice.plan.Plan.on_slices`). The old
        workload is deleted first (its pods stop; MaxText resumes from the latest committed checkpoint).
        """
        raise NotImplementedError(f"the {self.name} backend does not relaunch workloads on another slice count")

    def failure_report(self, name: str) -> str:
        """Why a workload failed: its reason, each failed pod's exit code and last log lines (its launcher's)."""
        launcher = self.launcher_of(name)
        if launcher is None:
            return f"{' or '.join(sorted({each.workload_kind for each in self.launchers}))} {name} does not exist"
        return launcher.failure_report(name)

    def pod_exits(self, name: str) -> list[PodExit]:
        """Each pod of the workload's latest attempt: slice, host, exit code and when it ended.

        Used to name the host that ended a failed workload (:mod:`multislice.remote_call`). The default
        (a backend that cannot tell) is an empty list.
        """
        return []

    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Delete a workload and stop its pods; False when there was none.

        With ``owner`` (a pipeline run id) only a workload that run created is deleted (its recorded
        ``pipeline/runid``, re-checked at delete time); another's is left and False returned. With
        ``grace_seconds``, its pods get that long after SIGTERM before SIGKILL instead of their
        ``terminationGracePeriodSeconds`` (a hung remote call: a host that catches SIGTERM must not hold the
        caller for the whole grace period).
        """
        launcher = self.launcher_of(name)
        return launcher is not None and launcher.delete(name, owner=owner, grace_seconds=grace_seconds)

    def workload_phase(self, name: str) -> str | None:
        """The workload's phase now (``Suspended``, ``Running``, ``Completed``, ``Failed``; locally also
        ``Deleted``, whose state and logs stay on disk), or None when it does not exist."""
        launcher = self.launcher_of(name)
        return None if launcher is None else launcher.phase(name)

    def host_log(
        self,
        name: str,
        slice_index: int,
        host: int,
        on_line: Callable[[str], None],
        follow: bool = False,
        tail: int | None = None,
    ) -> bool:
        """Pass on the log of one host's pod (the latest restart attempt) line by line.

        Args:
            name: The workload (JobSet) name.
            slice_index: The host's slice (child Job index).
            host: The host within its slice (completion index).
            on_line: Called with each line, in order.
            follow: Keep passing on new lines until the pod ends (or the workload is deleted).
            tail: Only the last ``tail`` lines (without ``follow``).

        Returns:
            False when the pod (or its log) is not there to read: the workload or its pods are gone.
        """
        raise NotImplementedError(f"the {self.name} backend does not read a host's log")

    @abc.abstractmethod
    def cleanup(self, pipeline_run_id: str, tell: Tell) -> tuple[list[str], list[str]]:
        """Delete what one pipeline run left unfinished; returns ``(deleted, kept completed)``.

        Only what ``pipeline_run_id`` created: selected by its ``pipeline/runid`` label and re-checked at delete
        time against the object deleted (locally its recorded labels under the name's lock; on GKE a ``uid``
        precondition), so an object another run created under the same name meanwhile is left alone.
        """

    @abc.abstractmethod
    def delete_abandoned(self, run_name: str, tell: Tell, pipeline_run_id: str = "") -> tuple[list[str], list[str]]:
        """``multislice cleanup --run NAME``: delete what runs of ``run_name`` left unfinished whose owner is gone.

        A workload whose pipeline run is alive (locally: the run directory's live owner, :mod:`multislice.ownership`;
        on GKE: its Lease is still renewed, :mod:`.gke.lease`) is kept. With ``pipeline_run_id``, only that run's.

        Returns:
            ``(deleted, kept)``: one line per thing deleted, and per thing kept because its run is alive.
        """

    # -- work in the trainer image ------------------------------------------

    @abc.abstractmethod
    def aot_session(self, plan: Plan, cache_dir: str | None, pipeline_run_id: str, tell: Tell) -> CompileSession:
        """Where this backend runs preflight's AOT compiles."""

    @abc.abstractmethod
    def run_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> VerificationReport:
        """Run the checkpoint verifier on the stage's checkpoint directory; its report.

        For a stage with ``export``, the verifier and then, on PASS, the exporter in one trainer process
        (:mod:`multislice.trainer.verify_export`), so that the export step's :meth:`run_exporter` reads that
        process's export instead of starting another: a trainer-environment process run to its end locally, a Job
        left running once its log has the verification on GKE. A verdict other than PASS exports nothing.

        Raises:
            VerifierTimeout: it ran past ``timings.verify_timeout`` (it was stopped).
            multislice.errors.RunFailed: the verifier left no report.
        """

    @abc.abstractmethod
    def run_exporter(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> ExportReport:
        """Export the stage's final checkpoint (``stage.export``, to ``stage.export_dir``) and check it; its report.

        With the stage's ``export_dtype`` and ``export_hub_repo`` (:func:`multislice.trainer.export.command`): the
        export of the process :meth:`run_verifier` started for this pipeline run (locally the report it left, on GKE
        its trainer-image Job on a CPU node pool, :mod:`multislice.backends.gke.exporter`, read to its end), else
        the exporter on its own. An export that could not run is refused at plan
        (:func:`multislice.config.checks.export_issues`), not here.

        Raises:
            VerifierTimeout: it ran past ``timings.verify_timeout`` (it was stopped).
            multislice.errors.RunFailed: the exporter left no report.
        """

    def run_data_workers(
        self, plan: Plan, stage: StagePlan, request: dict[str, Any], pipeline_run_id: str, tell: Tell
    ) -> list[WorkerExit]:
        """Run prepare_data's shard workers of ``request`` (:func:`multislice.trainer.prepare_shards.work_request`:
        ``request["workers"]`` ranges, at most ``data.parallelism`` at once) to their end; how each ended.

        Each runs ``python -m multislice.trainer.prepare_shards worker`` in the trainer image, on its range
        (:func:`multislice.trainer.prepare_shards.worker`), writing its part under ``request["parts_dir"]``; the
        step assembles the parts. Locally: trainer-environment processes; on GKE: an Indexed Job, one completion
        index per range (:mod:`multislice.backends.gke.data_workers`). Bounded by ``timings.prepare_data_timeout``.

        Raises:
            DataWorkersFailed: a worker failed, or they ran too long (the rest were stopped).
        """
        raise NotImplementedError(f"the {self.name} backend does not run prepare_data's shard workers")

    @abc.abstractmethod
    def delete_matching(self, labels: dict[str, str], tell: Tell) -> list[str]:
        """Delete every workload (and unfinished trainer-image Job) whose labels include ``labels``.

        What a cancelled step calls: it finds what the step created by the
        run's and stage's labels (:func:`multislice.render.jobset.run_labels`),
        not by a name held in memory, so a signal between "created" and "the
        step knows it" leaks nothing. Completed workloads are kept. ``labels``
        must hold the pipeline run id (``pipeline/runid``): only that run's
        objects are deleted, each re-checked at delete time as :meth:`cleanup` does.

        Returns:
            One line per thing deleted.

        Raises:
            ValueError: ``labels`` has no pipeline run id.
        """

    # -- cancellation -------------------------------------------------------

    @contextlib.contextmanager
    def holding(self, name: str, step: str, tell: Tell) -> Iterator[Any]:
        """While this context runs, the step holds workload ``name``: a workload no step holds is removed by the
        cluster's safety net once its hold expires (GKE: a renewed Lease and a reaper, :mod:`.gke.lease`).

        Here (the local backend): nothing to hold; its pods stop with the run's processes.
        """
        yield None

    def prepare_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> None:
        """Called by the train step as it starts following the stage: start what :meth:`run_verifier` will need,
        where the backend can do so ahead (locally: the verifier's process, its imports done while the stage
        trains, :mod:`.local.warm_tools`). Never raises for a failure to prepare: the verifier then starts as usual.

        Here (GKE): nothing; the verifier's Job starts in the verify step.
        """
        return None

    @contextlib.contextmanager
    def holding_run(self, run_name: str, run_dir: str, pipeline_run_id: str, step: str, tell: Tell) -> Iterator[Any]:
        """While this context runs, a step of pipeline run ``pipeline_run_id`` is alive: a run no step holds (and
        whose exit handler did not end it) is ended by the cluster's safety net once its hold expires (GKE: the
        run Lease, :func:`.gke.lease.hold_run`, and :func:`multislice.steps.cleanup.reap_runs`).

        Here (the local backend): nothing to hold; a cancelled local run ends with its processes.
        """
        yield None

    def expired_runs(self, now: Any = None) -> list[dict[str, str]]:
        """Pipeline runs whose hold expired before ``now`` (a ``datetime``; default now) with no exit handler
        to end them: ``[{"pipeline_run_id", "run_name", "run_dir", "step" (that renewed it last), "expired_at"}]``.

        Here (the local backend): none.
        """
        return []

    def end_run(self, pipeline_run_id: str, tell: Tell) -> None:  # noqa: B027 - optional, a no-op here
        """The exit handler ran for ``pipeline_run_id``: drop its hold (GKE: delete the run Lease). Here: nothing."""

    def release_node_pools(self, pipeline_run_id: str, tell: Tell) -> tuple[list[str], list[str]]:
        """Delete the node pools created for ``pipeline_run_id`` (a cancelled run's); ``(deleted, kept)``.

        Here (the local backend): there are none.
        """
        return [], []

    def claim_notification(self, pipeline_run_id: str, state: str, by: str) -> bool:
        """True for the one caller that posts the run's final notification (GKE: a tombstone Lease created once,
        :func:`.gke.lease.claim_notification`). Here: always True (the exit handler is the only sender)."""
        return True

    @contextlib.contextmanager
    def deleting_on_cancel(self, name: str, tell: Tell, labels: dict[str, str] | None = None) -> Iterator[None]:
        """Within this context SIGTERM or SIGINT (the run was cancelled) deletes workload ``name``.

        With ``labels``, every unfinished workload carrying them is deleted
        (:meth:`delete_matching`), else ``name``. Further signals during the
        deletion are ignored (:mod:`multislice.cancel`).

        Raises:
            TrainingFailed: on SIGTERM or SIGINT, after the workload was deleted.
        """
        with cancel.handling():
            try:
                yield
            except cancel.Cancelled as why:
                tell(f"cancelled ({why.signame}): deleting {name}")
                if labels and names.LABEL_PIPELINE_RUN_ID in labels:
                    self.delete_matching(labels, tell)
                else:
                    self.delete(name, owner=(labels or {}).get(names.LABEL_PIPELINE_RUN_ID))
                raise TrainingFailed(f"cancelled; {name} deleted") from None
