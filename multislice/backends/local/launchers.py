"""The local backend's launchers (:mod:`multislice.backends.launcher`): a stage's CPU JobSet, each pod a process.

:class:`JobSetLauncher` runs a stage's multislice JobSet as processes of this machine (:mod:`.jobsets`, its
supervisor restarts it as JobSet's failure policy says). :class:`RayLauncher` runs a stage with ``launcher: ray``
as the one-pod JobSet of its RayJob (:func:`multislice.render.jobset.render_ray_driver_jobset`): the pod
(:mod:`multislice.trainer.ray_job`) starts a Ray head with the dashboard, waits for KubeRay's probe
(``/api/healthz`` on the dashboard agent) and submits the driver through Ray's Jobs API, as KubeRay does; the
driver's ``JaxTrainer`` runs one CPU worker per emulated host, and Ray Train, not the JobSet, retries failed
workers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from multislice import names
from multislice.backends.base import Finished, LaunchFailed, Running, Submission, Tell, TrainingFailed, WorkloadDeleted
from multislice.backends.launcher import Launcher
from multislice.backends.local.inotify import FILE_EVENTS, Watch
from multislice.backends.local.jobsets import FINISHED
from multislice.backends.local.state import JobSetState
from multislice.plan import Plan, StagePlan
from multislice.render import launchers
from multislice.render.ray import DRIVER_MODULE
from multislice.reports import PodPlacement

if TYPE_CHECKING:
    from multislice.backends.local.backend import LocalBackend

#: Last lines of a failed pod's log quoted in a failure report.
TAIL_LINES = 25

#: How many times one train step replaces a lost local supervisor before it fails the stage.
MAX_TAKEOVERS = 3

#: The line each Ray worker group attempt's leader prints (:mod:`multislice.trainer.ray_driver`).
RAY_LEADER = re.compile(r"multislice ray worker: rank 0 of \d+")


def _all_running(state: JobSetState) -> bool:
    return state.phase == "Running" and bool(state.pods) and all(p.phase == "Running" for p in state.pods)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file; empty when there is none."""
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def pass_on(path: Path, offset: int, on_line: Callable[[str], None], final: bool) -> int:
    """Pass on the complete lines of ``path`` after ``offset`` (the last partial one too when ``final``)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
    except FileNotFoundError:
        return offset
    end = len(chunk) if final else chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
        on_line(line)
    return offset + end


#: The restarts of an ended workload, from its final state.
RestartsOf = Callable[[JobSetState], int]


class JobSetLauncher(Launcher):
    """A stage's multislice JobSet on this machine: one process per pod, run by a detached supervisor.

    Args:
        backend: The local backend (its ``jobsets`` and ``timings``).
    """

    kind = launchers.KINDS["jobset"]
    workload_kind = "JobSet"
    #: How a message names the workload.
    what = "JobSet"

    def __init__(self, backend: LocalBackend):
        self.backend = backend
        self.jobsets = backend.jobsets
        self.timings = backend.timings

    def render(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's CPU workload (:meth:`multislice.render.launchers.LauncherKind.render`)."""
        return self.kind.render(plan, stage, "cpu", pipeline_run_id)

    def phase(self, name: str) -> str | None:
        """The JobSet's phase from its state file (``Deleted`` ones keep their state and logs); None when absent."""
        state = self.jobsets.get_jobset(name)
        return None if state is None else state.phase

    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the JobSet (its supervisor starts the pods), adopt an identical one, or replace a finished one
        of another pipeline run (:meth:`.LocalJobSets.create_jobset`)."""
        name = manifest["metadata"]["name"]
        before = self.jobsets.get_jobset(name)
        state = self.jobsets.create_jobset(manifest)
        adopted = before is not None and before.phase != "Deleted" and before.created_at == state.created_at
        replaced = None
        if before is not None and not adopted and before.phase in FINISHED:
            replaced = before.labels.get(names.LABEL_PIPELINE_RUN_ID)
        return Submission(name=name, adopted=adopted, replaced=replaced)

    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait for every pod process of the workload to start; pod -> slice, host, process id."""
        try:
            state = self.jobsets.wait(
                stage.workload, _all_running, timeout=self.timings.launch_timeout, poll=self.timings.poll_seconds
            )
        except KeyError:
            raise WorkloadDeleted(f"{self.what} {stage.workload} was deleted before all its pods ran") from None
        except TimeoutError as error:
            raise LaunchFailed(str(error), "read the pods' logs; raise timeouts.launch if start-up is slow") from None
        if state.phase != "Completed" and not _all_running(state):  # Completed: finished before we looked
            exits = ", ".join(f"{p.hostname} exit {p.exit_code}" for p in state.pods if p.exit_code is not None)
            raise LaunchFailed(
                f"{self.what} {stage.workload} is {state.phase} ({state.reason}: {state.message}) before all pods ran; "
                f"{exits}",
                f"read the pods' logs under {self.jobsets.state_dir(stage.workload) / 'pods'}",
            )
        placement = {
            p.hostname: PodPlacement(slice=p.job_index, host=p.completion_index, node="localhost", pid=p.pid)
            for p in state.pods
        }
        slices = {p.slice for p in placement.values()}
        if len(placement) != self.expected_pods(plan) or len(slices) != self.expected_slices(plan):
            raise LaunchFailed(
                f"{self.what} {stage.workload} runs {len(placement)} pods in {len(slices)} slices; {self.shape(plan)}",
                "render it (`multislice render`) and compare its replicas and parallelism with the plan",
            )
        return Running(placement=placement, note=self.running_note(plan))

    def expected_slices(self, plan: Plan) -> int:
        """Slices (child Jobs) its pods run in: the plan's."""
        return plan.spec.num_slices

    def shape(self, plan: Plan) -> str:
        """What the plan asks for, as a launch failure says it."""
        return f"the plan has {plan.spec.num_slices} slices x {plan.slice.hosts} hosts"

    def running_note(self, plan: Plan) -> str:
        """What the launch report says about where the pods run."""
        return "local backend: every pod is a process on this machine; a slice is the set of processes of one child Job"

    def leader_lines(self, on_line: Callable[[str], None]) -> tuple[Callable[[str], None], RestartsOf]:
        """``(what the leader's lines go through, the restarts of the ended workload)``: the JobSet's restarts of
        either kind (recreated or in place: :attr:`.state.JobSetState.attempt`)."""
        return on_line, lambda state: state.attempt

    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Follow the workload's state and pass on each new line of every attempt's leader log, in order, woken by
        each change of either (:mod:`.inotify`).

        A lost supervisor is replaced (:meth:`LocalJobSets.take_over`), as a
        cluster restarts a JobSet controller, at most :data:`MAX_TAKEOVERS` times.
        """
        name, what = stage.workload, self.what
        on_line, restarts_of = self.leader_lines(on_line)
        read: dict[int, int] = {}  # attempt -> bytes of its leader log passed on
        events_seen = 0
        takeovers = 0
        deadline = time.monotonic() + self.timings.train_timeout
        # Woken by events (:mod:`.inotify`): the state replaced, the leader's log grown, the supervisor's end. An
        # elastic stage's ``interrupt`` reads the clock and the capacity too: it is asked at least every poll_seconds.
        with Watch(fallback_seconds=self.timings.poll_seconds) as watch:
            while True:
                self.jobsets.watch_state(watch, name)
                state = self.jobsets.get_jobset(name)
                if state is None or state.phase == "Deleted":
                    raise WorkloadDeleted(f"{what} {name} was deleted during training")
                if state.reason == "SupervisorLost" and takeovers < MAX_TAKEOVERS:
                    takeovers += 1
                    tell(f"{what} {name}: {state.message}; starting a new supervisor ({takeovers} of {MAX_TAKEOVERS})")
                    state = self.jobsets.take_over(name)
                for event in state.events[events_seen:]:
                    tell(f"{what} event {event.reason}: {event.message}")
                events_seen = len(state.events)
                watch.add(self.jobsets.pod_log(name, 0, 0, state.attempt), FILE_EVENTS)
                if not state.terminal:
                    watch.add_process(state.supervisor_pid)
                for attempt in range(state.attempt + 1):
                    log, final = self.jobsets.pod_log(name, 0, 0, attempt), state.terminal or attempt < state.attempt
                    read[attempt] = pass_on(log, read.get(attempt, 0), on_line, final=final)
                if state.terminal:
                    break
                if interrupt is not None and interrupt():
                    # Stop the pods first, then pass on what they logged up to then: no step line is lost.
                    self.jobsets.delete_jobset(name, timeout=self.timings.delete_timeout)
                    for attempt in range(state.attempt + 1):
                        pass_on(self.jobsets.pod_log(name, 0, 0, attempt), read.get(attempt, 0), on_line, final=True)
                    return Finished(phase="Interrupted", restarts=state.attempt, leader_logs=[],
                                    restart_causes=_restart_causes(state))  # fmt: skip
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrainingFailed(
                        f"{what} {name} still {state.phase} after {self.timings.train_timeout:.0f} s",
                        "raise timeouts.train if the stage needs longer",
                    )
                watch.wait(left if interrupt is None else min(left, self.timings.poll_seconds))
        logs = [str(self.jobsets.pod_log(name, 0, 0, attempt)) for attempt in range(state.attempt + 1)]
        return Finished(phase=state.phase, restarts=restarts_of(state), leader_logs=logs,
                        restart_causes=_restart_causes(state))  # fmt: skip

    def failure_report(self, name: str) -> str:
        """The workload's reason and restarts, then each failed pod's exit code and last log lines."""
        state = self.jobsets.get_jobset(name)
        if state is None:
            return f"{self.what} {name} does not exist"
        lines = [f"{self.what} {name} {state.phase}: {state.reason}: {state.message} (restarts: {state.attempt})"]
        for pod in state.pods:
            if pod.phase == "Failed" or pod.exit_code not in (None, 0):
                lines.append(
                    f"pod {pod.hostname} (slice {pod.job_index}, host {pod.completion_index}) exit code "
                    f"{pod.exit_code}; last log lines ({pod.log}):"
                )
                lines.append(tail(Path(pod.log)))
        return "\n".join(lines)

    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Stop the JobSet's supervisor and pods (its state and logs stay); False when there was none to stop (or,
        with ``owner``, it is another pipeline run's: :meth:`.LocalJobSets.delete_jobset`). Returns once every
        pod process has ended (SIGKILL after ``grace_seconds``, default the pods' ``terminationGracePeriodSeconds``).
        """
        state = self.jobsets.get_jobset(name)
        if state is None or state.phase == "Deleted":
            return False
        final = self.jobsets.delete_jobset(
            name, timeout=self.timings.delete_timeout, owner=owner, grace_seconds=grace_seconds
        )
        return final is not None


class RayLauncher(JobSetLauncher):
    """A stage with ``launcher: ray``: the one-pod JobSet of its RayJob. The pod runs a Ray head with the
    dashboard and submits the driver through Ray's Jobs API (:mod:`multislice.trainer.ray_job`); the pod's log
    is the job's log, followed through the Jobs API, and its exit the job's status. The driver's ``JaxTrainer``
    runs one CPU worker per emulated host. The pod never restarts; Ray Train retries the worker group inside it
    (``FailureConfig(max_failures=max_restarts)``)."""

    kind = launchers.KINDS["ray"]
    what = "Ray driver"

    def phase(self, name: str) -> str | None:
        """The driver's phase; None when ``name`` is not a Ray driver's JobSet (its pod does not run
        :data:`DRIVER_MODULE`) or does not exist."""
        state = self.jobsets.get_jobset(name)
        return None if state is None or not self._is_driver(name) else state.phase

    def _is_driver(self, name: str) -> bool:
        try:
            manifest = yaml.safe_load((self.jobsets.state_dir(name) / "jobset.yaml").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        for job in manifest.get("spec", {}).get("replicatedJobs", []):
            for container in job["template"]["spec"]["template"]["spec"].get("containers", []):
                if DRIVER_MODULE in [*container.get("command", []), *container.get("args", [])]:
                    return True
        return False

    def expected_pods(self, plan: Plan) -> int:
        """One: the driver (its JaxTrainer starts a Ray worker per emulated host)."""
        return 1

    def expected_slices(self, plan: Plan) -> int:
        """One: the driver's."""
        return 1

    def shape(self, plan: Plan) -> str:
        """The driver is one pod."""
        return "the Ray driver is one pod"

    def running_note(self, plan: Plan) -> str:
        """The Ray workers and how their ranks map to emulated hosts."""
        return (
            "local backend, launcher ray: the driver pod runs a Ray head and submits the driver through the Jobs "
            "API; its JaxTrainer starts "
            f"{plan.spec.num_slices * plan.slice.hosts} CPU workers, one per emulated host; worker rank r is "
            f"host r % {plan.slice.hosts} of slice r // {plan.slice.hosts}"
        )

    def leader_lines(self, on_line: Callable[[str], None]) -> tuple[Callable[[str], None], RestartsOf]:
        """Ray Train's retries: each worker group attempt's leader announces itself once (:data:`RAY_LEADER`), so
        retries = leader starts - 1."""
        starts = 0

        def counted(line: str) -> None:
            nonlocal starts
            if RAY_LEADER.search(line):
                starts += 1
            on_line(line)

        return counted, lambda state: max(0, starts - 1)


def _restart_causes(state: Any) -> list[str]:
    """Why each of the JobSet's restarts happened: the supervisor's ``JobFailed`` event (the Job, the pod and its
    exit code, the failure policy rule) or, under in-place restart, ``PodFailed`` event of each restarted attempt,
    in order."""
    return [e.message for e in state.events if e.reason in ("JobFailed", "PodFailed")][: state.attempt]
