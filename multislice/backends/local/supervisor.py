"""The supervisor of one locally run JobSet: runs its pods as processes and applies its policies.

Started detached by :class:`multislice.backends.local.LocalBackend` as
``python -m multislice.backends.local.supervisor STATE_DIR TRAINER_ENV``, it
outlives the pipeline step that created the JobSet, so a later step can watch
the JobSet through ``state.json``.

It does for one JobSet what the JobSet and Job controllers do on a cluster:

- starts every pod of the current restart attempt (see :mod:`.pods`), each a
  process group of its own running the container command in the trainer
  environment, logging to ``pods/<hostname>.attempt-<N>.log``; the pods of an
  attempt share this machine's network, so where they name a JAX coordinator
  port (``JAX_COORDINATOR_PORT``) they get a free port of this machine instead,
  as pods in a network namespace of their own would have theirs;
- on the first pod failure, finds the Job failure reason as the Job
  controller would (a matching ``podFailurePolicy`` FailJob rule gives
  ``PodFailurePolicy``; otherwise, with ``backoffLimit: 0``,
  ``BackoffLimitExceeded``), then the first matching JobSet
  ``failurePolicy`` rule (none matching means ``RestartJobSet``):
  ``FailJobSet`` fails the JobSet; ``RestartJobSet`` stops every pod and
  starts a new attempt while ``restartsCountTowardsMax < maxRestarts`` and
  fails it with ``ReachedMaxRestarts`` after that;
  ``RestartJobSetAndIgnoreMaxRestarts`` restarts without counting
  (JobSet KEP-262, ``keps/262-ConfigurableFailurePolicy``); a restart gives the
  surviving pods :data:`RESTART_GRACE_SECONDS` after SIGTERM, not their whole
  grace period. Such a restart recreates the pods (``restartStrategy:
  Recreate``, the default): new pods, ``status.restarts`` + 1;
- under ``restartStrategy: InPlaceRestart`` (JobSet v0.12.0, KEP-467:
  ``keps/467-InPlaceRestart/README.md``), plays the in-place restart agent of
  each pod and the JobSet controller's part (``pkg/controllers/in_place_restart.go``;
  the agent: ``cmd/in-place-restart-agent/main.go``): a pod failure that does
  not fail its Job (no ``FailJob`` rule matches: :func:`restarts_in_place`)
  restarts the pods in place, each keeping its name, host identity and
  environment, with a new process (cold: nothing of the old one survives but
  what survives on a node, the files it wrote); see :meth:`Supervisor.restart_in_place`;
- starts every pod as a new process, whatever the attempt (as a cluster
  starts a container: nothing is pre-started);
- completes the JobSet when every pod has succeeded;
- on SIGTERM (delete), stops every pod: SIGTERM to each process group, then
  SIGKILL after the pod's ``terminationGracePeriodSeconds``;
- when the ``multislice run`` that started its run ends unannounced (SIGKILL: no
  step is left to delete the JobSet), deletes it as on SIGTERM
  (:func:`multislice.cancel.watch_driver`; a JobSet of a pipeline run without such a driver is left alone);
- if it is itself SIGKILLed, its pods get SIGKILL from the kernel
  (``PR_SET_PDEATHSIG``, :func:`multislice.cancel.die_with_parent`), and the
  steps watching the JobSet see it Failed with reason ``SupervisorLost``.

It never leaves a pod process behind: whatever ends the supervisor's loop,
its ``finally`` stops the pods it started. A supervisor started for a JobSet
whose state already lists pods is taking over from a lost one
(:meth:`.jobsets.LocalJobSets.take_over`): it kills what is left of the old
attempt's process groups and starts the next attempt, as a restart that does
not count towards ``maxRestarts``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from multislice import cancel, maxtext
from multislice.backends.local import capacity
from multislice.backends.local.environment import free_port
from multislice.backends.local.inotify import Watch
from multislice.backends.local.pods import LocalPod, expand_jobset
from multislice.backends.local.state import (
    GRACE_FILE,
    IN_PLACE_RESTART_ATTEMPT_KEY,
    JobSetState,
    Phase,
    PodState,
    read_state,
    write_state,
)
from multislice.cancel import die_with_parent

#: The longest the supervisor sleeps where no event can wake it (no inotify or pidfds: :mod:`.inotify`), seconds.
POLL_SECONDS = 0.25
#: The longest one wait for events lasts where they can wake it: a bound, not an interval (nothing is due then).
IDLE_SECONDS = 60.0
#: How long the surviving pods of a failed attempt get between SIGTERM and SIGKILL when the JobSet restarts, seconds
#: (at most their ``terminationGracePeriodSeconds``). A survivor that can end does so at once; one that cannot is
#: held by JAX's preemption notifier until its next sync point (a collective with the failed pod, which never
#: comes) or blocked in such a collective, and a checkpoint in flight cannot commit without the failed pod's
#: shards: waiting out its grace period (30 s) would only delay the restart. On GKE the JobSet controller deletes
#: the child Jobs (foreground, no grace override: JobSet v0.12.0, ``pkg/controllers/jobset_controller.go``,
#: ``deleteJobs``), so there the survivors get their whole grace period (docs/testing.md).
RESTART_GRACE_SECONDS = 2.0
#: ``spec.failurePolicy.restartStrategy`` of in-place restart (JobSet v0.12.0, ``api/jobset/v1alpha2/jobset_types.go``).
IN_PLACE = "InPlaceRestart"


def exit_code_of(returncode: int) -> int:
    """Container-style exit code: the status, or 128 + signal number when killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def job_failure_reason(job_spec: dict[str, Any], container: str, exit_code: int | None) -> tuple[str, str]:
    """Why the Job controller fails a Job whose pod exited with ``exit_code`` (``backoffLimit: 0``).

    Returns:
        ``(reason, message)``: ``PodFailurePolicy`` when a FailJob rule matches
        the exit code, else ``BackoffLimitExceeded``.
    """
    for i, rule in enumerate(job_spec.get("podFailurePolicy", {}).get("rules", [])):
        codes = rule.get("onExitCodes")
        if not codes or codes.get("containerName") not in (None, container):
            continue
        inside = exit_code in codes.get("values", [])
        if inside == (codes["operator"] == "In"):
            if rule["action"] == "FailJob":
                return (
                    "PodFailurePolicy",
                    f"Container {container} failed with exit code {exit_code} matching FailJob rule at index {i}",
                )
            break  # Count: the failure counts towards backoffLimit
    return "BackoffLimitExceeded", f"Job has reached the specified backoff limit (pod exit code {exit_code})"


def failure_policy_action(
    failure_policy: dict[str, Any], reason: str, message: str, replicated_job: str
) -> tuple[str, str]:
    """The JobSet failure-policy action for a failed child Job, and the rule that chose it.

    Rules are tried in order; a rule matches when its reason list is empty or
    holds ``reason``, its message patterns are empty or one matches, and its
    target list is empty or holds the replicated job. No match: ``RestartJobSet``.
    """
    for rule in failure_policy.get("rules", []):
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        targets = rule.get("targetReplicatedJobs") or []
        if reasons and reason not in reasons:
            continue
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        if targets and replicated_job not in targets:
            continue
        return rule["action"], rule.get("name", "")
    return "RestartJobSet", "(default)"


def restarts_in_place(job_spec: dict[str, Any], container: dict[str, Any], exit_code: int | None) -> bool:
    """Whether, under ``restartStrategy: InPlaceRestart``, a pod whose container exited with ``exit_code`` is
    restarted in place rather than failing its Job.

    The container's ``restartPolicyRules`` decide where it has them (Kubernetes' container restart rules, KEP-5307:
    the first rule whose ``exitCodes`` match; ``RestartAllContainers`` restarts the pod in place, as the KEP-467
    example's worker rule ``NotIn [0]`` does). Otherwise, and where no rule matched, the pod fails; its Job fails
    only on a ``podFailurePolicy`` FailJob rule (``backoffLimit`` is 2147483647 under in-place restart: JobSet
    v0.12.0 ``pkg/webhooks/jobset_webhook.go``), and else the Job replaces the pod (``podReplacementPolicy:
    Failed``), whose new agent takes the next in-place restart attempt: the same group restart.
    """
    for rule in container.get("restartPolicyRules") or []:
        codes = rule.get("exitCodes") or {}
        if (exit_code in codes.get("values", [])) == (codes.get("operator") == "In"):
            if rule.get("action") == "RestartAllContainers":
                return True
            break
    reason, _ = job_failure_reason(job_spec, container["name"], exit_code)
    return reason != "PodFailurePolicy"


class Supervisor:
    """Runs the pods of one JobSet until it completes, fails or is deleted."""

    def __init__(self, state_dir: Path, trainer_env: Path):
        self.state_dir = state_dir
        self.trainer_env = trainer_env
        self.manifest = yaml.safe_load((state_dir / "jobset.yaml").read_text(encoding="utf-8"))
        self.state = read_state(state_dir) or JobSetState(name=self.manifest["metadata"]["name"])
        self.state.supervisor_pid = os.getpid()
        self.procs: dict[str, subprocess.Popen] = {}
        self.pods: dict[str, LocalPod] = {}
        self.deleting = False
        self.spec = self.manifest["spec"]
        self.failure_policy = self.spec.get("failurePolicy", {})
        self.state.max_restarts = int(self.failure_policy.get("maxRestarts", 0))
        self.state.restart_strategy = self.failure_policy.get("restartStrategy", "Recreate")
        self.recreate = True  # the next start creates the pods (first start, Recreate); else restarts them in place
        self.waiting_for_capacity = False
        self.watch = Watch(fallback_seconds=POLL_SECONDS)  # pod exits, signals, the capacity file (run)

    # -- pod processes --------------------------------------------------

    def _pod_env(self, pod: LocalPod) -> dict[str, str]:
        env = {
            "PATH": f"{self.trainer_env / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "VIRTUAL_ENV": str(self.trainer_env),
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": pod.hostname,
        }
        if os.environ.get("PYTHONPATH"):  # a source checkout run with PYTHONPATH: pods run the same code
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        # A Hugging Face token for a private or gated dataset: as a cluster pod gets it from a Secret, a local pod
        # gets this machine's (huggingface_hub reads $HF_TOKEN when MaxText's hf_access_token is unset).
        if os.environ.get("HF_TOKEN"):
            env["HF_TOKEN"] = os.environ["HF_TOKEN"]
        # The Ray driver's test hook (multislice.trainer.ray_driver.KILL_HOOK_ENV), set by the end-to-end test.
        if os.environ.get("MULTISLICE_RAY_KILL_WORKER"):
            env["MULTISLICE_RAY_KILL_WORKER"] = os.environ["MULTISLICE_RAY_KILL_WORKER"]
        env.update(pod.env)
        return env

    def _grace_seconds(self) -> float:
        asked = self.state_dir / GRACE_FILE  # a delete with its own grace period (LocalJobSets.delete_jobset)
        try:
            return float(asked.read_text(encoding="ascii"))
        except (OSError, ValueError):
            pass
        template = self.spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return float(template.get("terminationGracePeriodSeconds", 30))

    def start_attempt(self) -> None:
        """Start the pods of the current attempt (:attr:`JobSetState.attempt`): create them (the first start, and
        any restart that recreates them) or restart them in place, each as a new process."""
        attempt = self.state.attempt
        if self.recreate:
            self.state.pods = [
                PodState(
                    hostname=pod.hostname,
                    job_index=pod.job_index,
                    completion_index=pod.completion_index,
                    attempt=attempt,
                    log="",
                )
                for pod in expand_jobset(self.manifest, restart_attempt=self.state.restarts)
            ]
            if self.state.restart_strategy == IN_PLACE:
                for pod_state in self.state.pods:  # each new pod's agent takes its attempt; the barrier lifts
                    self._agent_starts(pod_state)
                self._reconcile_in_place()
        # Each container's environment as its pod is now (in place: the same pod, its annotations since updated).
        annotated = {p.hostname: p.annotations for p in self.state.pods}
        self.pods = {
            p.hostname: p
            for p in expand_jobset(self.manifest, restart_attempt=self.state.restarts, annotated=annotated)
        }
        (self.state_dir / "pods").mkdir(exist_ok=True)
        self.procs.clear()
        if any(maxtext.ENV_COORDINATOR_PORT in pod.env for pod in self.pods.values()):
            port = str(free_port())
            for pod in self.pods.values():
                pod.env[maxtext.ENV_COORDINATOR_PORT] = port
            self.state.event("CoordinatorPort", f"attempt {attempt}: JAX coordinator on 127.0.0.1:{port}")
        for pod_state in self.state.pods:
            pod = self.pods[pod_state.hostname]
            log_path = self.state_dir / "pods" / f"{pod.hostname}.attempt-{attempt}.log"
            proc = self._launch(pod.argv, self._pod_env(pod), log_path)
            self.procs[pod.hostname] = proc
            pod_state.attempt, pod_state.pid, pod_state.phase = attempt, proc.pid, "Running"
            pod_state.log, pod_state.started_at = str(log_path), time.time()
            pod_state.exit_code = pod_state.finished_at = None
        self.state.phase = "Running"
        if self.recreate:
            how = "started"
        else:
            how = f"restarted in place (in-place restart attempt {self.state.current_in_place_restart_attempt}):"
        self.state.event("Started", f"attempt {attempt}: {how} {len(self.pods)} pods, each a new process")
        write_state(self.state_dir, self.state)

    def _launch(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """A pod's container as a new process: a session of its own (its pid is its process group's, stopped as
        one), killed when this supervisor ends, logging to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv,
                env=env,
                cwd=self.state_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # a SIGKILLed supervisor's pods die with it
            )

    # -- in-place restart (JobSet v0.12.0, KEP-467) ---------------------

    def _agent_starts(self, pod_state: PodState) -> None:
        """What the pod's in-place restart agent does as it starts (``cmd/in-place-restart-agent/main.go``,
        ``Reconcile``): annotate the pod with the in-place restart attempt after the JobSet's current one (0 when
        there is none yet)."""
        current = self.state.current_in_place_restart_attempt
        pod_state.annotations[IN_PLACE_RESTART_ATTEMPT_KEY] = str(0 if current is None else current + 1)

    def _pod_attempts(self) -> list[int]:
        """The pods' in-place restart attempts (``getPodInPlaceRestartAttempts``). Every pod counts: under
        in-place restart no pod's phase is Failed (its containers restart), whatever its process did."""
        return [p.in_place_restart_attempt for p in self.state.pods if p.in_place_restart_attempt is not None]

    def _in_place_exceeded(self) -> str | None:
        """Why the controller fails the JobSet with ``ReachedMaxRestarts`` now, or None
        (``reconcileInPlaceRestart``: a container restarted more than ``maxRestarts`` times, or the highest pod
        attempt, less the restarts that do not count (``status.restarts - restartsCountTowardsMax``), above
        ``maxRestarts``: ``exceededMaxRestarts``)."""
        most = max((p.restart_count for p in self.state.pods), default=0)
        if most > self.state.max_restarts:
            return f"a container restarted {most} times"
        attempts = self._pod_attempts()
        uncounted = self.state.restarts - self.state.restarts_count_towards_max
        counted = (max(attempts) if attempts else 0) - uncounted
        if counted > self.state.max_restarts:
            return f"in-place restart attempt {counted} (counted towards maxRestarts)"
        return None

    def _reconcile_in_place(self) -> None:
        """The JobSet controller's in-place step (``reconcileInPlaceRestart``, after its max-restarts checks): every
        pod at the same attempt makes it ``status.currentInPlaceRestartAttempt`` (the agents lift their barriers);
        otherwise, past attempt 0, ``status.previousInPlaceRestartAttempt`` becomes the highest attempt - 1 (never
        lowered), which makes the agents of the pods at or below it restart theirs."""
        attempts = self._pod_attempts()
        if len(attempts) == len(self.state.pods) and attempts and len(set(attempts)) == 1:
            self.state.current_in_place_restart_attempt = attempts[0]
            return
        if not attempts or max(attempts) == 0:
            return
        previous = max(attempts) - 1
        if (was := self.state.previous_in_place_restart_attempt) is None or previous > was:
            self.state.previous_in_place_restart_attempt = previous

    def _controller_reconciles(self, failed: PodState) -> bool:
        """One pass of the controller's in-place reconcile: fail the JobSet past ``maxRestarts`` (False), else move
        the previous / current attempts (:meth:`_reconcile_in_place`)."""
        if (why := self._in_place_exceeded()) is not None:
            self._reached_max_restarts(failed, why)
            return False
        self._reconcile_in_place()
        return True

    def restart_in_place(self, failed: PodState) -> bool:
        """Restart every pod in place after ``failed``'s container exited (``restartStrategy: InPlaceRestart``).
        Returns False when the JobSet failed instead (``ReachedMaxRestarts``).

        The protocol of JobSet v0.12.0 (KEP-467), each side played here: the kubelet restarts the failed pod's
        containers (its ``RestartAllContainers`` rule); its agent starts again and takes attempt current + 1; the
        controller fails the JobSet past ``maxRestarts`` (:meth:`_in_place_exceeded`), else sets
        ``previousInPlaceRestartAttempt`` to that attempt - 1; each other pod's agent, its attempt now outdated,
        exits, and the kubelet restarts that pod's containers too (its worker is stopped: SIGTERM,
        :data:`RESTART_GRACE_SECONDS`, SIGKILL), and its agent takes the same attempt; every pod at it, the
        controller makes it ``currentInPlaceRestartAttempt`` and the barriers lift: each pod's worker starts as a
        new process, with the pod's name, hostname and environment (the pod is the same), logging to the next
        attempt's log. ``status.restarts`` is unchanged: no pod was recreated.
        """
        failed.restart_count += 1
        self._agent_starts(failed)
        if not self._controller_reconciles(failed):
            return False
        previous = self.state.previous_in_place_restart_attempt
        outdated = [
            p
            for p in self.state.pods
            if p is not failed and previous is not None and (p.in_place_restart_attempt or 0) <= previous
        ]
        self.stop_pods(
            [p for p in outdated if p.phase == "Running"],
            f"their agents restart them in place after pod {failed.hostname} failed",
            RESTART_GRACE_SECONDS,
        )
        for pod_state in outdated:
            pod_state.restart_count += 1
            self._agent_starts(pod_state)
        if not self._controller_reconciles(failed):
            return False
        self.state.attempt += 1
        self.recreate = False
        self.state.event(
            "InPlaceRestart",
            f"in-place restart attempt {self.state.current_in_place_restart_attempt} "
            f"(previous {self.state.previous_in_place_restart_attempt}) of at most {self.state.max_restarts}: "
            f"{len(self.state.pods)} pods keep their names and hosts",
        )
        self.start_when_capacity()
        return True

    def _reached_max_restarts(self, pod_state: PodState, why: str) -> None:
        self._finish(
            "Failed",
            "ReachedMaxRestarts",
            f"jobset failed due to reaching max number of restarts ({self.state.max_restarts}): {why}; "
            f"last failure: pod {pod_state.hostname} exit code {pod_state.exit_code}",
        )

    def _capacity_short(self) -> str | None:
        """Why the capacity model (:mod:`.capacity`) cannot hold this JobSet's slices now, or None when it can."""
        replicas = sum(int(r.get("replicas", 1)) for r in self.spec["replicatedJobs"])
        have = capacity.available(self.state_dir.parent.parent)
        if have is None or have >= replicas:
            return None
        return f"{replicas} slice(s) needed, {have} available (capacity withdrawn: Spot preemption)"

    def start_when_capacity(self) -> None:
        """Start the next attempt now, or wait ``Pending`` (``InsufficientCapacity``) until the capacity holds it."""
        short = self._capacity_short()
        if short is None:
            if self.waiting_for_capacity:
                self.state.event("CapacityAvailable", "capacity for every slice is back; starting the attempt")
            self.waiting_for_capacity = False
            self.state.reason = self.state.message = ""
            self.start_attempt()
            return
        if not self.waiting_for_capacity:
            self.waiting_for_capacity = True
            self.state.phase, self.state.reason, self.state.message = "Pending", "InsufficientCapacity", short
            self.state.event("InsufficientCapacity", f"attempt {self.state.attempt} waits: {short}")
            write_state(self.state_dir, self.state)

    def _reap(self) -> list[PodState]:
        """Record pods that exited since the last poll; return those that failed."""
        failed = []
        for pod_state in self.state.pods:
            proc = self.procs.get(pod_state.hostname)
            if proc is None or pod_state.phase != "Running":
                continue
            code = proc.poll()
            if code is None:
                continue
            pod_state.exit_code = exit_code_of(code)
            pod_state.finished_at = time.time()
            pod_state.phase = "Succeeded" if code == 0 else "Failed"
            if code != 0:
                failed.append(pod_state)
        return failed

    def stop_all(self, why: str, grace_seconds: float | None = None) -> None:
        """SIGTERM every running pod's process group, SIGKILL after the grace period (``grace_seconds``, at most
        the pods' own), wait for all."""
        self.stop_pods([p for p in self.state.pods if p.phase == "Running"], why, grace_seconds)

    def stop_pods(self, pods: list[PodState], why: str, grace_seconds: float | None = None) -> None:
        """:meth:`stop_all` for the running ones of ``pods``."""
        running = [p for p in pods if p.phase == "Running" and p.hostname in self.procs]
        for pod_state in running:
            _signal_group(pod_state.pid, signal.SIGTERM)
        grace = self._grace_seconds() if grace_seconds is None else min(grace_seconds, self._grace_seconds())
        deadline = time.monotonic() + grace
        for pod_state in running:  # each pod's end wakes the wait (its pidfd)
            self.watch.add_process(pod_state.pid)
        while any(self.procs[p.hostname].poll() is None for p in running) and time.monotonic() < deadline:
            self.watch.wait(deadline - time.monotonic())
        for pod_state in running:
            _signal_group(pod_state.pid, signal.SIGKILL)
        for pod_state in running:
            code = self.procs[pod_state.hostname].wait()
            pod_state.exit_code = exit_code_of(code)
            pod_state.finished_at = time.time()
            pod_state.phase = "Succeeded" if code == 0 else "Failed"
        if running:
            self.state.event("Stopped", f"stopped {len(running)} running pods: {why}")

    # -- policy ---------------------------------------------------------

    def handle_failure(self, pod_state: PodState) -> bool:
        """Apply the failure policies to a failed pod. Returns True to keep running."""
        pod = self.pods[pod_state.hostname]
        rj = next(r for r in self.spec["replicatedJobs"] if r["name"] == pod.replicated_job)
        container = rj["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
        if self.state.restart_strategy == IN_PLACE and restarts_in_place(
            rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]["containers"][0], pod_state.exit_code
        ):
            self.state.event(
                "PodFailed",
                f"pod {pod.hostname} of Job {pod.job} exited with code {pod_state.exit_code}; restartStrategy "
                "InPlaceRestart: its containers restart in place, and every other pod's with them",
            )
            return self.restart_in_place(pod_state)
        reason, message = job_failure_reason(rj["template"]["spec"], container, pod_state.exit_code)
        action, rule = failure_policy_action(self.failure_policy, reason, message, pod.replicated_job)
        self.state.event(
            "JobFailed",
            f"Job {pod.job} failed: {reason}: pod {pod.hostname} exited with code {pod_state.exit_code}; "
            f"failure policy rule {rule}: {action}",
        )
        counted = action == "RestartJobSet"
        if action == "FailJobSet":
            why = f"{action} (rule {rule}) after Job {pod.job} failed with {reason}: {message}"
            self._finish("Failed", "FailJobSetAction", why)
            return False
        if counted and self.state.restarts_count_towards_max >= self.state.max_restarts:
            self._reached_max_restarts(pod_state, f"{self.state.restarts_count_towards_max} restarts counted")
            return False
        self.stop_all(f"restarting the JobSet after {pod.job} failed", grace_seconds=RESTART_GRACE_SECONDS)
        self.state.restarts += 1
        self.state.attempt += 1
        self.recreate = True
        if counted:
            self.state.restarts_count_towards_max += 1
        self.state.event("Restarting", f"restart {self.state.restarts} of at most {self.state.max_restarts} ({action})")
        self.start_when_capacity()
        return True

    def _finish(self, phase: Phase, reason: str, message: str) -> None:
        self.stop_all(message)
        self.state.phase = phase
        self.state.reason = reason
        self.state.message = message
        self.state.finished_at = time.time()
        self.state.event(reason, message)
        write_state(self.state_dir, self.state)

    # -- main loop ------------------------------------------------------

    def run(self) -> int:
        """Run until terminal. Returns 0 (the JobSet's outcome is in ``state.json``).

        Event-driven (:mod:`.inotify`): the loop wakes when a pod process ends (its pidfd), on SIGTERM or SIGINT (a
        delete: :func:`signal.set_wakeup_fd`), and while it waits for capacity, when the capacity file is replaced
        or a withdrawal's time is up. ``state.json`` is written when the state changed, so each write is news to
        the steps waiting on it.
        """
        signal.signal(signal.SIGTERM, self._on_delete)
        signal.signal(signal.SIGINT, self._on_delete)
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        cancel.watch_driver()  # the run's driver gone: SIGTERM to this process, a delete
        self.watch.add_wakeup(wake_read)
        run_dir = self.state_dir.parent.parent
        try:
            if self.state.pods:
                self.take_over()
            self.start_when_capacity()
            while True:
                if self.deleting:
                    self._finish("Deleted", "Deleted", "the JobSet was deleted")
                    return 0
                if self.waiting_for_capacity:
                    self.watch.add(run_dir)  # capacity.json replaced (capacity.restore, withdraw)
                    self.start_when_capacity()
                    if self.waiting_for_capacity:
                        returns = capacity.next_return(run_dir)  # a withdrawal whose time is up
                        self.watch.wait(IDLE_SECONDS if returns is None else min(returns, IDLE_SECONDS))
                    continue
                for pod_state in self.state.pods:  # watched before reaped: an exit after the reap wakes the wait
                    if pod_state.phase == "Running":
                        self.watch.add_process(pod_state.pid)
                before = self.state.model_dump_json()
                failed = self._reap()
                if failed:
                    first = min(failed, key=lambda p: p.finished_at or 0)
                    write_state(self.state_dir, self.state)
                    if not self.handle_failure(first):
                        return 0
                    continue
                if all(p.phase == "Succeeded" for p in self.state.pods):
                    self._finish("Completed", "AllJobsCompleted", "jobset completed successfully")
                    return 0
                if self.state.model_dump_json() != before:
                    write_state(self.state_dir, self.state)
                if not self.deleting:
                    self.watch.wait(IDLE_SECONDS)
        except BaseException as error:  # stop the pods whatever happened, then report
            self._finish("Failed", "SupervisorError", f"the local supervisor failed: {error!r}")
            raise
        finally:
            for pod_state in self.state.pods:
                if (
                    pod_state.pid
                    and self.procs.get(pod_state.hostname)
                    and self.procs[pod_state.hostname].poll() is None
                ):
                    _signal_group(pod_state.pid, signal.SIGKILL)
            signal.set_wakeup_fd(-1)
            self.watch.close()
            os.close(wake_read)
            os.close(wake_write)

    def take_over(self) -> None:
        """Stop what a lost supervisor's pods left running and count the next attempt as a restart."""
        left = [p for p in self.state.pods if p.phase == "Running"]
        for pod_state in left:
            _signal_group(pod_state.pid, signal.SIGKILL)
            pod_state.phase = "Failed"
            pod_state.finished_at = time.time()
        self.state.restarts += 1
        self.state.attempt += 1
        self.recreate = True  # its pods are recreated, as the JobSet controller recreates lost ones
        self.state.event(
            "SupervisorRestarted",
            f"the previous supervisor was lost; {len(left)} pods of attempt {self.state.attempt - 1} stopped; "
            f"restart {self.state.restarts} (not counted towards maxRestarts)",
        )

    def _on_delete(self, signum: int, frame: Any) -> None:
        self.deleting = True


def _signal_group(pid: int | None, sig: signal.Signals) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m multislice.backends.local.supervisor STATE_DIR TRAINER_ENV``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m multislice.backends.local.supervisor STATE_DIR TRAINER_ENV", file=sys.stderr)
        return 2
    return Supervisor(Path(args[0]), Path(args[1])).run()


if __name__ == "__main__":
    sys.exit(main())
