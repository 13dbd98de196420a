"""The on-disk state of a locally run JobSet, shared by its supervisor and the steps.

Layout of a JobSet's state directory (``<run_dir>/jobsets/<jobset>/``)::

    jobset.yaml                      the manifest as created
    state.json                       JobSetState, rewritten atomically by the supervisor
    supervisor.log                   the supervisor's own log
    pods/<hostname>.attempt-<N>.log  stdout+stderr of each pod, per attempt (N: JobSetState.attempt, every
                                     restart of the pods' processes, recreated or in place)

Only the supervisor writes ``state.json``; readers may see it at any moment
(writes go to a temporary file and are renamed into place).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

Phase = Literal["Pending", "Running", "Completed", "Failed", "Deleted"]
PodPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
TERMINAL: frozenset[str] = frozenset({"Completed", "Failed", "Deleted"})

#: File of a JobSet's state directory holding the grace period (seconds) of a delete that asked for one
#: (:meth:`.jobsets.LocalJobSets.delete_jobset`); the supervisor reads it when it stops its pods, in place of the
#: manifest's ``terminationGracePeriodSeconds``.
GRACE_FILE = "delete-grace"

#: ``spec.failurePolicy.restartStrategy`` values the local supervisor carries out (JobSet v0.12.0,
#: ``api/jobset/v1alpha2/jobset_types.go``: ``Recreate``, the default, and ``InPlaceRestart``, KEP-467).
RestartStrategy = Literal["Recreate", "InPlaceRestart"]
#: The pod annotation the in-place restart agent keeps (``InPlaceRestartAttemptKey``, JobSet v0.12.0,
#: ``api/jobset/v1alpha2/jobset_types.go``).
IN_PLACE_RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/in-place-restart-attempt"


class PodState(BaseModel):
    """One pod (process) of the current restart attempt.

    Attributes:
        hostname: Pod hostname, ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``.
        job_index: Child Job (slice) index.
        completion_index: Pod index within its Job (host within the slice).
        attempt: The attempt of the JobSet's pods (:attr:`JobSetState.attempt`) its current process belongs to.
        pid: Process id of its current process while running (also its process group id).
        phase: Pending, Running, Succeeded or Failed.
        exit_code: Container exit code: the process's status, or 128 + signal number.
        log: Path of the pod's log for this attempt.
        started_at: Unix time its current process started, seconds.
        finished_at: Unix time it exited, seconds.
        restart_count: Restarts of its container in place (``status.containerStatuses[].restartCount``): under
            ``InPlaceRestart`` a pod lives through restarts, each a new process; a recreated pod starts at 0.
        annotations: The annotations the JobSet's agents and controllers keep on the pod; under
            ``InPlaceRestart``, :data:`IN_PLACE_RESTART_ATTEMPT_KEY`.
    """

    hostname: str
    job_index: int
    completion_index: int
    attempt: int
    pid: int | None = None
    phase: PodPhase = "Pending"
    exit_code: int | None = None
    log: str
    started_at: float | None = None
    finished_at: float | None = None
    restart_count: int = 0
    annotations: dict[str, str] = Field(default_factory=dict)

    @property
    def in_place_restart_attempt(self) -> int | None:
        """The pod's :data:`IN_PLACE_RESTART_ATTEMPT_KEY` annotation, or None where it has none."""
        value = self.annotations.get(IN_PLACE_RESTART_ATTEMPT_KEY)
        return None if value is None else int(value)


class Event(BaseModel):
    """A Kubernetes-style event: what happened, when (Unix seconds), and why."""

    time: float
    reason: str
    message: str


class JobSetState(BaseModel):
    """Status of a locally run JobSet, mirroring the JobSet status fields users know.

    Attributes:
        name: JobSet name.
        labels: JobSet labels (run id, run name, stage, queue).
        phase: Pending, Running, Completed, Failed or Deleted.
        reason: Reason of a terminal phase, as JobSet names it
            (AllJobsCompleted, FailJobSetAction, ReachedMaxRestarts, Deleted, SupervisorLost).
        message: Human explanation of ``reason``.
        restarts: JobSet restarts so far (``status.restarts``): the restarts that recreated every pod. In-place
            restarts do not count here (the controller leaves ``status.restarts`` alone for them).
        restarts_count_towards_max: Of those, the ones counted against ``maxRestarts``.
        max_restarts: ``spec.failurePolicy.maxRestarts``.
        restart_strategy: ``spec.failurePolicy.restartStrategy``.
        previous_in_place_restart_attempt: ``status.previousInPlaceRestartAttempt`` (``InPlaceRestart`` only).
        current_in_place_restart_attempt: ``status.currentInPlaceRestartAttempt`` (``InPlaceRestart`` only).
        attempt: Restarts of the pods' processes so far, of either kind (recreated, in place, or after a lost
            supervisor): the ``N`` of the pods' logs ``pods/<hostname>.attempt-<N>.log``. A local figure, not a
            JobSet status field.
        supervisor_pid: Process id of the supervisor keeping this state.
        pods: Pods of the current attempt.
        events: Everything that happened, oldest first.
        created_at: Unix time of creation, seconds.
        finished_at: Unix time of the terminal phase, seconds.
    """

    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    phase: Phase = "Pending"
    reason: str = ""
    message: str = ""
    restarts: int = 0
    restarts_count_towards_max: int = 0
    max_restarts: int = 0
    restart_strategy: RestartStrategy = "Recreate"
    previous_in_place_restart_attempt: int | None = None
    current_in_place_restart_attempt: int | None = None
    attempt: int = 0
    supervisor_pid: int | None = None
    pods: list[PodState] = Field(default_factory=list)
    events: list[Event] = Field(default_factory=list)
    created_at: float = Field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def terminal(self) -> bool:
        """True once Completed, Failed or Deleted."""
        return self.phase in TERMINAL

    def event(self, reason: str, message: str) -> None:
        """Append an event stamped now."""
        self.events.append(Event(time=time.time(), reason=reason, message=message))

    def pod(self, job_index: int, completion_index: int) -> PodState:
        """The pod of a slice and host in the current attempt. Raises KeyError."""
        for pod in self.pods:
            if pod.job_index == job_index and pod.completion_index == completion_index:
                return pod
        raise KeyError(f"{self.name} has no pod for slice {job_index} host {completion_index}")


def state_path(state_dir: Path) -> Path:
    """``state.json`` of a JobSet state directory."""
    return state_dir / "state.json"


def read_state(state_dir: Path) -> JobSetState | None:
    """The current state, or None when the JobSet was never created here."""
    path = state_path(state_dir)
    try:
        return JobSetState.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def write_state(state_dir: Path, state: JobSetState) -> None:
    """Atomically replace ``state.json``."""
    path = state_path(state_dir)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(state.model_dump(mode="json"), indent=1), encoding="utf-8")
    os.replace(tmp, path)
