"""The launcher interface: how one backend launches one kind of workload (a JobSet, a RayJob).

A second axis under the backend interface, in the style of kubeflow/sdk's nested adapters
(``kubeflow/trainer/backends/container/adapters/base.py``: one ``ContainerBackend``, one
``BaseContainerClientAdapter`` per container runtime, chosen once). A backend
(:class:`multislice.backends.base.Backend`) owns the place (a cluster, this machine) and what is common to every
workload there (capacity, admission, the Lease, cleanup); a :class:`Launcher` owns one kind of workload on it: its
manifest, create-or-adopt, phase, expected pods, the wait until its pods run and where, following it to its end, its
failure report and its deletion. The backend looks a stage's launcher up once
(:meth:`~multislice.backends.base.Backend.launcher_for`) and delegates; what a launcher renders and needs on the
render side (CRDs, RBAC, DRANET) is its :class:`multislice.render.launchers.LauncherKind`.

Implementations: on GKE :class:`multislice.backends.gke.launchers.JobSetLauncher` and
:class:`~multislice.backends.gke.launchers.RayJobLauncher`; on the local backend
:class:`multislice.backends.local.launchers.JobSetLauncher` (each pod a process) and
:class:`~multislice.backends.local.launchers.RayLauncher` (the local Ray driver).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from multislice.plan import Plan, StagePlan
from multislice.render.launchers import LauncherKind

if TYPE_CHECKING:
    from multislice.backends.base import Finished, Running, Submission, Tell


class Launcher(abc.ABC):
    """One kind of workload on one backend.

    Attributes:
        kind: What it renders and needs (:mod:`multislice.render.launchers`); a backend picks the launcher whose
            ``kind`` is the stage's.
        workload_kind: The object kind it creates on its backend (``JobSet``, ``RayJob``); :meth:`submit` is asked
            of the launcher whose ``workload_kind`` is the manifest's.
        crds: CRD name -> version it needs served besides the JobSet's and Kueue's (GKE).
    """

    kind: ClassVar[LauncherKind]
    workload_kind: ClassVar[str]
    crds: ClassVar[dict[str, str]] = {}

    @abc.abstractmethod
    def render(self, plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
        """The stage's workload manifest for this backend's hardware.

        Raises:
            ValueError: ``pipeline_run_id`` is not a valid label value.
        """

    @abc.abstractmethod
    def submit(self, manifest: dict[str, Any]) -> Submission:
        """Create the workload, adopt one of the same name and spec, or replace a finished one of another run.

        Raises:
            multislice.backends.base.WorkloadConflict: the name is taken by another spec.
        """

    @abc.abstractmethod
    def phase(self, name: str) -> str | None:
        """The workload's phase (``Suspended``, ``Running``, ``Completed``, ``Failed``; locally also ``Deleted``), or
        None when it does not exist."""

    def expected_pods(self, plan: Plan) -> int:
        """Pods that run the stage's training once all have started: one per host of every slice."""
        return plan.spec.num_slices * plan.slice.hosts

    @abc.abstractmethod
    def wait_running(self, plan: Plan, stage: StagePlan, tell: Tell) -> Running:
        """Wait until :meth:`expected_pods` run (``timings.launch_timeout``); where they run.

        Raises:
            multislice.backends.base.LaunchFailed: they cannot all start, or not in time.
            multislice.backends.base.WorkloadDeleted: the workload was deleted while waiting.
        """

    @abc.abstractmethod
    def follow(
        self,
        plan: Plan,
        stage: StagePlan,
        on_line: Callable[[str], None],
        tell: Tell,
        interrupt: Callable[[], bool] | None = None,
    ) -> Finished:
        """Follow the workload to its end (:meth:`multislice.backends.base.Backend.follow`)."""

    @abc.abstractmethod
    def failure_report(self, name: str) -> str:
        """Why the workload failed: its reason, each failed pod's exit code and last log lines."""

    @abc.abstractmethod
    def delete(self, name: str, owner: str | None = None, grace_seconds: float | None = None) -> bool:
        """Delete the workload and stop its pods; False when there was none (or, with ``owner``, another run's)
        (:meth:`multislice.backends.base.Backend.delete`)."""
