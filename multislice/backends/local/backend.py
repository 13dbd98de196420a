"""The local backend: a run's workloads as processes of this machine.

Each pod of a stage's (CPU) JobSet is a process of the trainer environment,
run by a detached supervisor (:mod:`.jobsets`, :mod:`.supervisor`); preflight's
compiles (:mod:`.aot`), the checkpoint verifier (:mod:`.verifier`) and
prepare_data's shard workers (:mod:`.data_workers`) are processes too. What it models and what it does not:

- kept: JobSet validation against its CRD, create-or-adopt by manifest,
  child Jobs and pods as the JobSet and Job controllers name them, failure
  policy and restarts, deletion stopping every process;
- not modelled: node pools, scheduling and placement (every pod runs here),
  Kueue (a JobSet is admitted when created), images (the trainer environment
  stands in for the trainer image), and pod network namespaces (each JobSet
  attempt gets a free coordinator port of this machine instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from multislice import maxtext, names, ownership, reports
from multislice.backends.base import (
    Admission,
    Backend,
    PodExit,
    Tell,
    WorkerExit,
    WorkloadDeleted,
)
from multislice.backends.local import capacity, data_workers, environment, exporter, launchers, verifier, warm_tools
from multislice.backends.local.aot import AotSession
from multislice.backends.local.environment import InsufficientCapacity
from multislice.backends.local.inotify import FILE_EVENTS, Watch
from multislice.backends.local.jobsets import LocalJobSets
from multislice.backends.local.pods import expand_jobset
from multislice.backends.local.tools import Runner, run_tool
from multislice.plan import Plan, StagePlan
from multislice.preflight import CompileSession, work_dir_for
from multislice.render.jobset import LOCAL_RAYJOB_MODULE
from multislice.reports import ExportReport, ProvisionReport, VerificationReport
from multislice.timings import DEFAULTS, Timings
from multislice.trainer import verify, verify_export

#: The pod programs that train a stage: the JobSet worker (MaxText in each pod) and the local RayJob's driver pod
#: (:data:`multislice.render.jobset.LOCAL_RAYJOB_MODULE`: a Ray head whose JaxTrainer runs MaxText in its workers).
TRAINING_MODULES = frozenset({maxtext.WORKER_MODULE, LOCAL_RAYJOB_MODULE})


def runs_module(argv: list[str], modules: frozenset[str]) -> bool:
    """Whether a pod's command is ``<python> -m <module> ...`` with ``module`` among ``modules``."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in modules


class LocalBackend(Backend):
    """Runs a run's CPU JobSets, compiles and verifier on this machine.

    Args:
        run_dir: The run directory (a local path); JobSet state and pod logs go under ``run_dir/jobsets``.
        timings: The waits (default :data:`multislice.timings.DEFAULTS` ``["local"]``).
    """

    name = "local"
    hardware = "cpu"
    elastic = True
    launcher_classes = (launchers.RayLauncher, launchers.JobSetLauncher)  # a Ray driver's JobSet is its launcher's

    def __init__(self, run_dir: str | Path, timings: Timings | None = None):
        super().__init__(timings or DEFAULTS["local"])
        self.run_dir = str(run_dir)
        self.jobsets = LocalJobSets(run_dir)

    @classmethod
    def where_logs_are(cls, plan: Plan) -> str:
        """Each pod's log per restart attempt, in the JobSet's state directory."""
        return f"{plan.run_dir}/jobsets/<jobset>/pods/<pod>.attempt-<N>.log"

    # -- capacity ---------------------------------------------------------

    def provision(
        self, plan: Plan, kueue_objects: list[dict[str, Any]], tell: Tell, pipeline_run_id: str = ""
    ) -> ProvisionReport:
        """Check this machine can host the emulated slices; write (not apply) the Kueue objects.

        Raises:
            environment.TrainerEnvMissing: no trainer environment.
            InsufficientCapacity: not enough memory for the processes.
        """
        spec = plan.spec
        env = environment.trainer_env()
        versions = environment.trainer_versions(env)
        processes = spec.num_slices * plan.slice.hosts
        needed = processes * environment.BYTES_PER_PROCESS
        available = environment.available_memory_bytes()
        if available < needed:
            raise InsufficientCapacity(
                f"{processes} trainer processes ({spec.num_slices} slices x {plan.slice.hosts} hosts) need about "
                f"{needed / 2**30:.0f} GiB of memory; {available / 2**30:.1f} GiB is available",
                "lower num_slices, or use a TPU type with fewer hosts per slice",
            )
        note = (
            "local backend: no node pools are created and no Kueue objects are applied; this machine hosts "
            f"{spec.num_slices} emulated {plan.slice.name} slices as {processes} processes with "
            f"{plan.slice.chips_per_host} CPU devices each (one per chip)"
        )
        tell(note)
        tell(f"trainer environment {env}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        applied = [f"{o['kind']}/{o['metadata']['name']}" for o in kueue_objects]
        tell(f"Kueue objects rendered and validated (not applied): {', '.join(applied)}")
        return ProvisionReport(
            backend=self.name,
            note=note,
            kueue_objects=applied,
            capacity={
                "processes": processes,
                "devices": plan.total_chips,
                "cpu_cores": os.cpu_count(),
                "memory_needed_bytes": needed,
                "memory_available_bytes": available,
            },
            trainer_env=str(env),
            trainer_versions=versions,
        )

    # -- a stage's workload -------------------------------------------------

    def wait_admitted(self, plan: Plan, stage: StagePlan, tell: Tell) -> Admission:
        """At once: there is no Kueue here; a created JobSet runs."""
        if self.jobsets.get_jobset(stage.workload) is None:
            raise WorkloadDeleted(f"JobSet {stage.workload} does not exist on the local backend", "rerun the stage")
        return Admission(
            cluster_queue=plan.spec.cluster_queue,
            flavors=[plan.slice.flavor_name],
            wait_seconds=0.0,
            note="local backend: no Kueue; a JobSet is admitted as soon as it is created",
        )

    def available_slices(self, plan: Plan) -> int | None:
        """Slices the capacity model (:mod:`.capacity`) holds now; ``num_slices`` when it models none."""
        found = capacity.available(self.run_dir)
        return plan.spec.num_slices if found is None else found

    def lost_slice(self, name: str) -> str | None:
        """Why JobSet ``name`` waits for capacity (a slice was preempted and its restart cannot start), or None."""
        state = self.jobsets.get_jobset(name)
        if state is not None and state.phase == "Pending" and state.reason == "InsufficientCapacity":
            return state.message
        return None

    def relaunch(self, plan: Plan, stage: StagePlan, tell: Tell) -> None:
        """Delete the stage's JobSet and create it for ``plan.spec.num_slices`` slices, same pipeline run label."""
        old = self.jobsets.get_jobset(stage.workload)
        run_id = (old.labels if old else {}).get(names.LABEL_PIPELINE_RUN_ID, "manual")
        if old is not None and old.phase != "Deleted":
            self.jobsets.delete_jobset(stage.workload, timeout=self.timings.delete_timeout)
        manifest = self.workload_manifest(plan, stage, run_id)
        self.jobsets.create_jobset(manifest)
        tell(f"JobSet {stage.workload} relaunched on {plan.spec.num_slices} slice(s)")

    def pod_exits(self, name: str) -> list[PodExit]:
        """Each pod of the JobSet's latest attempt, from its state file (exit codes as the supervisor reaped them)."""
        state = self.jobsets.get_jobset(name)
        if state is None:
            return []
        return [PodExit(p.job_index, p.completion_index, p.exit_code, p.finished_at) for p in state.pods]

    def host_log(
        self,
        name: str,
        slice_index: int,
        host: int,
        on_line: Callable[[str], None],
        follow: bool = False,
        tail: int | None = None,
    ) -> bool:
        """Pass on a pod's log file of the latest attempt (kept after the JobSet ended or was deleted); following,
        until that pod's process ended (woken by the log's growth and the JobSet's state changes, :mod:`.inotify`).
        False when there is no log."""
        state = self.jobsets.get_jobset(name)
        if state is None:
            return False
        path = self.jobsets.pod_log(name, slice_index, host)
        if not follow:
            if not path.exists():
                return False
            text = path.read_text(encoding="utf-8", errors="replace") if tail is None else launchers.tail(path, tail)
            for line in text.splitlines():
                on_line(line)
            return True
        offset = 0
        with Watch(fallback_seconds=self.timings.poll_seconds) as watch:
            while True:
                self.jobsets.watch_state(watch, name)
                watch.add(path, FILE_EVENTS)
                state = self.jobsets.get_jobset(name)
                pods = state.pods if state is not None else []
                pod = next((p for p in pods if (p.job_index, p.completion_index) == (slice_index, host)), None)
                ended = state is None or state.terminal or (pod is not None and pod.phase in ("Succeeded", "Failed"))
                offset = launchers.pass_on(path, offset, on_line, final=ended)
                if ended:
                    return True
                watch.add_process(state.supervisor_pid if state is not None else None)
                watch.wait(self.timings.train_timeout)

    def cleanup(self, pipeline_run_id: str, tell: Tell) -> tuple[list[str], list[str]]:
        """Delete the pipeline run's JobSets that have not completed; completed ones are kept.

        Selected by the ``pipeline/runid`` label, and each re-checked under its name's lock as it is deleted.
        """
        deleted, kept = [], []
        for stage in warm_tools.stop_run(self.run_dir, pipeline_run_id):
            deleted.append(f"the verifier started ahead for stage {stage} (unused)")
        for state in self.jobsets.list_jobsets({names.LABEL_PIPELINE_RUN_ID: pipeline_run_id}):
            if state.phase == "Completed":
                kept.append(state.name)
                continue
            if state.phase == "Deleted":
                continue
            final = self.jobsets.delete_jobset(state.name, timeout=self.timings.delete_timeout, owner=pipeline_run_id)
            if final is not None:
                deleted.append(f"JobSet {state.name} ({state.phase} -> {final.phase})")
        return deleted, kept

    def delete_matching(self, labels: dict[str, str], tell: Tell) -> list[str]:
        """Stop every JobSet of this run directory whose labels include ``labels`` and that is still going, and the
        pipeline run's verifiers started ahead (:mod:`.warm_tools`).

        Still going: not terminal, or Failed with ``SupervisorLost`` (its pods may need killing). Only the
        pipeline run's in ``labels``, re-checked under the name's lock (:meth:`.LocalJobSets.delete_jobset`).

        Raises:
            ValueError: ``labels`` has no pipeline run id.
        """
        owner = labels.get(names.LABEL_PIPELINE_RUN_ID)
        if not owner:
            raise ValueError(f"delete_matching needs the pipeline run id label {names.LABEL_PIPELINE_RUN_ID}")
        deleted = []
        for stage in warm_tools.stop_run(self.run_dir, owner):  # a cancelled run verifies nothing
            tell(f"stopped the verifier started ahead for stage {stage}")
        for state in self.jobsets.list_jobsets(labels):
            if state.terminal and state.reason != "SupervisorLost":
                continue
            final = self.jobsets.delete_jobset(state.name, timeout=self.timings.delete_timeout, owner=owner)
            if final is None:
                continue
            deleted.append(f"JobSet {state.name} ({state.phase} -> {final.phase})")
            tell(f"deleted {deleted[-1]}")
        return deleted

    def delete_abandoned(self, run_name: str, tell: Tell, pipeline_run_id: str = "") -> tuple[list[str], list[str]]:
        """Stop the run directory's JobSets still going whose pipeline run is not the directory's live owner.

        Alive here means provably running on this machine: ``multislice run`` holding the directory's lock
        (:mod:`multislice.ownership`); its JobSets are kept. A lease (a pipeline run whose steps are separate
        processes) cannot tell a crashed run from one between two steps, so the user's explicit cleanup wins over
        it. Each other JobSet is deleted as its own pipeline run would delete it (:meth:`.LocalJobSets.delete_jobset`
        with that run id as owner); one with no pipeline run id by name (made by hand or by a test).
        """
        live = ownership.read_owner(self.run_dir)
        if live is not None and (live.expires is not None or not ownership.alive(self.run_dir, live)):
            live = None
        deleted, kept = [], []
        for state in self.jobsets.list_jobsets():
            run_id = state.labels.get(names.LABEL_PIPELINE_RUN_ID, "")
            if pipeline_run_id and run_id != pipeline_run_id:
                continue
            if state.terminal and state.reason != "SupervisorLost":
                continue
            if live is not None and run_id and run_id == live.pipeline_run_id:
                kept.append(f"JobSet {state.name}: its pipeline run {run_id} is still running ({live.describe()})")
                continue
            final = self.jobsets.delete_jobset(state.name, timeout=self.timings.delete_timeout, owner=run_id or None)
            if final is not None:
                deleted.append(f"JobSet {state.name} ({state.phase} -> {final.phase})")
        return deleted, kept

    # -- work in the trainer environment --------------------------------------

    def aot_session(self, plan: Plan, cache_dir: str | None, pipeline_run_id: str, tell: Tell) -> CompileSession:
        """A trainer-environment process of this machine (:class:`.aot.AotSession`)."""
        return AotSession(cache_dir, work_dir_for(plan))

    def _verifier_command(self, plan: Plan, stage: StagePlan, card: dict[str, Any] | None) -> list[str]:
        """The command :meth:`run_verifier` runs for the stage (with the model card ``card`` for an export)."""
        if not stage.export:
            return verifier.command(stage)
        return exporter.command(stage, plan.spec.exporter.hub_token_secret, card, combined=True)

    def prepare_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> None:
        """Start the stage's verifier ahead (:mod:`.warm_tools`): its imports run while the stage trains, and the
        verify step of this pipeline run hands it the finished checkpoint. Not for a command wrapped to read a Hub
        token from Secret Manager, an elastic stage's, or a stage trained without a pipeline run id (those
        verifiers start in the verify step, as before)."""
        if not pipeline_run_id or stage.elastic or not warm_tools.enabled():
            return  # no run to hand it to; an elastic stage's JobSet (whose end the tool waits for) is replaced
        state = self.jobsets.get_jobset(stage.workload)
        if state is None or state.terminal or not state.supervisor_pid or not self._runs_the_trainer(stage.workload):
            return  # nothing trains (or a test's scripted pods do): no verifier to prepare
        try:
            argv = self._verifier_command(plan, stage, None)
            if argv[2] not in (verify.MODULE, verify_export.MODULE):
                return
            # it waits while the JobSet's supervisor runs, then a grace period for the verify step
            warm_tools.start(self.run_dir, stage.name, pipeline_run_id, argv, starter=state.supervisor_pid)
        except (OSError, environment.TrainerEnvMissing) as error:
            tell(f"the checkpoint verifier could not be started ahead ({error}); it starts in the verify step")
            return
        tell("the checkpoint verifier's process starts now: its imports run while the stage trains")

    def _runs_the_trainer(self, name: str) -> bool:
        """Whether JobSet ``name``'s pods run the trainer (:data:`TRAINING_MODULES`: the JobSet worker, or a Ray
        stage's driver pod, whose Ray workers run MaxText), not another command (a test's scripted pods)."""
        try:
            manifest = yaml.safe_load((self.jobsets.state_dir(name) / "jobset.yaml").read_text(encoding="utf-8"))
            return any(runs_module(pod.argv, TRAINING_MODULES) for pod in expand_jobset(manifest))
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            return False

    def _runner(self, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> Runner:
        """Runs the verifier's command in the process the train step started ahead for this pipeline run when it
        matches (:func:`.warm_tools.take`), else as a new process (:func:`.tools.run_tool`)."""

        def runner(argv: list[str], timeout: float, cancel_point: str, what: str):
            found = warm_tools.take(self.run_dir, stage.name, pipeline_run_id, argv)
            if found is None:
                return run_tool(argv, timeout, cancel_point, what)
            tell("in the verifier's process started during training (its imports done)")
            return warm_tools.run(found, argv, timeout, cancel_point, what)

        return runner

    def run_verifier(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> VerificationReport:
        """The verifier as a trainer-environment process (:func:`.verifier.run`); for a stage with ``export``, the
        verifier and then, on PASS, the exporter in one process (:func:`.exporter.verify_and_export`, bounded by
        twice the verify timeout), whose export report is left for the export step (:func:`.exporter.hand_over`).
        The process is the one the train step started ahead (:meth:`prepare_verifier`) when there is one.

        Raises:
            VerifierTimeout: it ran past its timeout (it was stopped).
            multislice.errors.RunFailed: it left no report.
        """
        runner = self._runner(stage, pipeline_run_id, tell)
        if not stage.export:
            return verifier.run(stage, stage.checkpoint_dir, self.timings.verify_timeout, runner)[1]
        tell("verifying, then exporting on PASS, in one trainer process")
        _, verification, exported = exporter.verify_and_export(
            stage, 2 * self.timings.verify_timeout, plan.spec.exporter.hub_token_secret,
            reports.model_card(plan, stage), runner,
        )  # fmt: skip
        if exported is not None:
            exporter.hand_over(stage, pipeline_run_id, exported)
        return verification

    def run_data_workers(
        self, plan: Plan, stage: StagePlan, request: dict[str, Any], pipeline_run_id: str, tell: Tell
    ) -> list[WorkerExit]:
        """prepare_data's shard workers as trainer-environment processes, ``data.parallelism`` at once
        (:func:`.data_workers.run`)."""
        parallelism = getattr(plan.spec.stage(stage.name).data, "parallelism", None)
        return data_workers.run(request, parallelism, self.timings.prepare_data_timeout, tell)

    def run_exporter(self, plan: Plan, stage: StagePlan, pipeline_run_id: str, tell: Tell) -> ExportReport:
        """The export report the verify step's process left for this pipeline run (:func:`.exporter.take_over`);
        else (none left: the step run on its own, or the verifier ran without the export) the exporter as a
        trainer-environment process (:func:`.exporter.run`), bounded by the verify timeout (raises VerifierTimeout)."""
        handed = exporter.take_over(stage, pipeline_run_id)
        if handed is not None:
            tell(f"the export the verifier's process made: verdict {handed.verdict}")
            return handed
        card = reports.model_card(plan, stage)
        return exporter.run(stage, self.timings.verify_timeout, plan.spec.exporter.hub_token_secret, card)[1]
