"""The local backend's JobSet API: CPU JobSets run on this machine, one process per pod.

What the Kubernetes API plus the JobSet and Job controllers are to the GKE
backend, :class:`LocalJobSets` is to the local one.

Each JobSet gets a state directory ``<run_dir>/jobsets/<name>/`` and a
detached supervisor process (:mod:`.supervisor`) that runs its pods in the
trainer environment and keeps ``state.json`` current, so that the pipeline
step that creates a JobSet and the steps that later watch it need not be the
same process.

Kubernetes semantics kept: a JobSet is validated against the JobSet CRD
before it is created; creating a name that exists is AlreadyExists unless it
is the same manifest (then the existing JobSet is adopted: a retried step
does not start a second copy) or a finished (Completed or Failed) JobSet of
another pipeline run, which is replaced, its state directory kept aside as
``<name>.replaced-<time>`` (a run continuing an earlier one, as on GKE);
a deleted JobSet stops every pod it started.
Not modelled: scheduling, node pools and Kueue (there is one machine; every
JobSet is admitted on creation), and pod network namespaces: all pods share
this machine's ports, so each JobSet attempt gets a free JAX coordinator port
(:mod:`.supervisor`) in place of MaxText's fixed 1234, and any number of
JobSets (and runs) can run at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from multislice import cancel, names
from multislice.backends.base import WorkloadConflict
from multislice.backends.local.environment import trainer_env
from multislice.backends.local.inotify import Watch
from multislice.backends.local.pods import UnsupportedManifest, expand_jobset
from multislice.backends.local.state import GRACE_FILE, JobSetState, read_state, write_state
from multislice.render import schema

#: ``backoffLimit`` of every Job under ``restartStrategy: InPlaceRestart`` (MaxInt32: JobSet v0.12.0,
#: ``pkg/webhooks/jobset_webhook.go``).
IN_PLACE_BACKOFF_LIMIT = 2147483647
#: Phases of a JobSet that holds nothing and may be replaced by another pipeline run of the same name.
FINISHED = frozenset({"Completed", "Failed"})


class AlreadyExists(WorkloadConflict):
    """A JobSet of that name exists with another manifest; nothing was changed."""


def pid_alive(pid: int | None) -> TypeGuard[int]:
    """True when a process with this pid exists and is not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


#: File of a JobSet's state directory holding its supervisor's pid, written by the creator as it starts it.
PID_FILE = "supervisor.pid"


def _write_pid(state_dir: Path, pid: int) -> None:
    tmp = state_dir / f"{PID_FILE}.tmp"
    tmp.write_text(str(pid), encoding="ascii")
    os.replace(tmp, state_dir / PID_FILE)


def _read_pid(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_FILE).read_text(encoding="ascii"))
    except (FileNotFoundError, ValueError):
        return None


def owned_by(state: JobSetState, owner: str) -> bool:
    """Whether JobSet ``state`` was created by pipeline run ``owner``: its recorded ``pipeline/runid`` label."""
    return bool(owner) and state.labels.get(names.LABEL_PIPELINE_RUN_ID) == owner


class LocalJobSets:
    """Creates, watches and deletes JobSets of one run on this machine.

    Args:
        run_dir: The run directory (``<output_dir>/<run_name>``); JobSet state
            lives under ``run_dir/jobsets``.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.jobsets_dir = self.run_dir / "jobsets"

    def state_dir(self, name: str) -> Path:
        """State directory of a JobSet."""
        return self.jobsets_dir / name

    @contextlib.contextmanager
    def _name_lock(self, name: str):
        """Serialise creating, replacing and deleting JobSet ``name`` across processes (``flock(2)`` on
        ``<run_dir>/.jobset-locks/<name>.lock``): what the API server's per-object write serialisation is on a
        cluster. So a delete that re-checked the owner acts on that JobSet, not on one another run created since."""
        locks = self.run_dir / ".jobset-locks"  # beside jobsets/, whose entries are the JobSets' state directories
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- create ---------------------------------------------------------

    def create_jobset(self, manifest: dict[str, Any], start_timeout: float = 60) -> JobSetState:
        """Create a JobSet and start its supervisor, or adopt an identical existing one.

        Raises:
            multislice.render.schema.ManifestInvalid: the manifest fails CRD validation.
            UnsupportedManifest: a field the local backend cannot honour.
            AlreadyExists: a JobSet of that name exists with another manifest.
            TrainerEnvMissing: no trainer environment.
        """
        schema.validate(manifest)
        self._check_supported(manifest)
        env = trainer_env()
        name = manifest["metadata"]["name"]
        with self._name_lock(name):
            found = self._create_locked(manifest, env)
        if isinstance(found, JobSetState):
            return found
        return self._await_supervisor(
            name, found, lambda s: s.phase != "Pending" or s.reason == "InsufficientCapacity", start_timeout
        )

    def _create_locked(self, manifest: dict[str, Any], env: Path) -> JobSetState | subprocess.Popen:
        """Under the name's lock: the existing JobSet to adopt, or the new supervisor process."""
        name = manifest["metadata"]["name"]
        state_dir = self.state_dir(name)
        existing = self.get_jobset(name)
        if existing is not None:
            old = yaml.safe_load((state_dir / "jobset.yaml").read_text(encoding="utf-8"))
            if old == manifest and existing.phase != "Deleted":
                return existing
            earlier = existing.labels.get(names.LABEL_PIPELINE_RUN_ID)
            ours = manifest["metadata"].get("labels", {}).get(names.LABEL_PIPELINE_RUN_ID)
            replace = existing.phase in FINISHED and earlier and ours and earlier != ours
            if existing.phase != "Deleted" and not replace:
                raise AlreadyExists(
                    f"JobSet {name} already exists ({existing.phase}, pipeline run "
                    f"{existing.labels.get(names.LABEL_PIPELINE_RUN_ID, '?')}) with a different spec; nothing was "
                    f"changed (its state is in {state_dir})",
                    "choose another run_name, or delete that JobSet first",
                )
            kind = "replaced" if replace else "deleted"  # a finished JobSet of an earlier run: its state kept aside
            stamp = f"{name}.{kind}-{int(existing.finished_at or time.time())}"
            aside = state_dir.with_name(stamp)
            for again in itertools.count(1):  # an elastic stage resized twice within a second: each kept apart
                if not aside.exists():
                    break
                aside = state_dir.with_name(f"{stamp}-{again}")
            state_dir.rename(aside)
        with cancel.shielded():  # a signal cannot split creating the JobSet and recording its supervisor
            state_dir.mkdir(parents=True)
            (state_dir / "jobset.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
            state = JobSetState(name=name, labels=manifest["metadata"].get("labels", {}))
            state.event("Created", f"JobSet {name} created on the local backend")
            write_state(state_dir, state)
            return self._spawn_supervisor(state_dir, env)

    def take_over(self, name: str, start_timeout: float = 60) -> JobSetState:
        """Start a new supervisor for a JobSet whose supervisor was lost (reported ``SupervisorLost``).

        What a restarted JobSet controller does on a cluster, for the local
        backend: the new supervisor stops whatever its predecessor's pods left
        running and starts a new attempt, which resumes from the latest
        checkpoint as any restart does; the restart does not count towards
        ``maxRestarts`` (the workload did not fail). See :mod:`.supervisor`.

        Raises:
            KeyError: no such JobSet.
            RuntimeError: the new supervisor did not start its pods within ``start_timeout`` seconds.
        """
        with self._name_lock(name):
            lost = self.get_jobset(name)
            if lost is None:
                raise KeyError(f"no JobSet {name} under {self.jobsets_dir}")
            if lost.reason != "SupervisorLost":
                return lost
            previous = lost.supervisor_pid
            with cancel.shielded():
                proc = self._spawn_supervisor(self.state_dir(name), trainer_env())
        return self._await_supervisor(
            name, proc, lambda s: s.supervisor_pid not in (None, previous) and s.phase != "Pending", start_timeout
        )

    @staticmethod
    def _spawn_supervisor(state_dir: Path, env: Path) -> subprocess.Popen:
        """Start the detached supervisor of the JobSet in ``state_dir`` and record its pid."""
        with open(state_dir / "supervisor.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "multislice.backends.local.supervisor", str(state_dir), str(env)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=state_dir,
            )
        _write_pid(state_dir, proc.pid)
        return proc

    def _await_supervisor(
        self, name: str, proc: subprocess.Popen, started: Callable[[JobSetState], bool], start_timeout: float
    ) -> JobSetState:
        """Wait until ``started`` holds for the JobSet's state (or it is terminal), woken by each state change
        (:meth:`wait_events`) and by the supervisor's end.

        Raises:
            RuntimeError: the supervisor ended, or ``started`` did not hold within ``start_timeout`` seconds.
            KeyError: the JobSet was deleted (its state directory removed) while starting.
        """
        state_dir = self.state_dir(name)
        deadline = time.monotonic() + start_timeout
        with Watch(fallback_seconds=0.1) as watch:
            watch.add_process(proc.pid)
            while True:
                self.watch_state(watch, name)
                current = read_state(state_dir)
                if current is None or started(current) or current.terminal:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (state_dir / "supervisor.log").read_text(encoding="utf-8", errors="replace")[-2000:]
                    raise RuntimeError(f"the local supervisor of JobSet {name} did not start its pods:\n{log}")
                watch.wait(deadline - time.monotonic())
        if current is None:  # deleted (its state directory removed) while starting
            raise KeyError(f"no JobSet {name} under {self.jobsets_dir}")
        return current

    @staticmethod
    def _check_supported(manifest: dict[str, Any]) -> None:
        """Refuse what the local supervisor cannot carry out as the controllers would. Under ``restartStrategy:
        InPlaceRestart`` each Job must be as JobSet v0.12.0's webhook requires (``pkg/webhooks/jobset_webhook.go``:
        ``backoffLimit`` 2147483647, ``podReplacementPolicy: Failed``, ``completions == parallelism``); the
        supervisor plays the in-place restart agent, so the pod needs none (:mod:`.supervisor`)."""
        strategy = manifest["spec"].get("failurePolicy", {}).get("restartStrategy", "Recreate")
        if strategy not in ("Recreate", "InPlaceRestart"):
            raise UnsupportedManifest(
                f"spec.failurePolicy.restartStrategy {strategy} is not supported locally: "
                "use Recreate or InPlaceRestart"
            )
        for rj in manifest["spec"]["replicatedJobs"]:
            job = rj["template"]["spec"]
            if strategy == "InPlaceRestart":
                where = f"replicatedJobs[{rj['name']}].template.spec"
                if job.get("backoffLimit") != IN_PLACE_BACKOFF_LIMIT:
                    raise UnsupportedManifest(
                        f"{where}.backoffLimit must be {IN_PLACE_BACKOFF_LIMIT} under restartStrategy InPlaceRestart "
                        f"(JobSet's webhook requires it), not {job.get('backoffLimit')}"
                    )
                if job.get("podReplacementPolicy") != "Failed":
                    raise UnsupportedManifest(
                        f"{where}.podReplacementPolicy must be Failed under restartStrategy InPlaceRestart "
                        f"(JobSet's webhook requires it), not {job.get('podReplacementPolicy')}"
                    )
                if job.get("completions") is None or job.get("completions") != job.get("parallelism"):
                    raise UnsupportedManifest(
                        f"{where}.completions must equal its parallelism under restartStrategy InPlaceRestart "
                        f"(JobSet's webhook requires it), not {job.get('completions')} and {job.get('parallelism')}"
                    )
            elif job.get("backoffLimit", 6) != 0:
                raise UnsupportedManifest(
                    f"replicatedJobs[{rj['name']}].template.spec.backoffLimit must be 0 on the local backend "
                    "(multislice JobSets use 0: any pod failure fails its Job)"
                )
            for rule in job.get("podFailurePolicy", {}).get("rules", []):
                if rule.get("action") not in ("FailJob", "Count"):
                    raise UnsupportedManifest(f"podFailurePolicy action {rule.get('action')} is not supported locally")
        for rule in manifest["spec"].get("failurePolicy", {}).get("rules", []):
            if rule["action"] not in ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
                raise UnsupportedManifest(f"failurePolicy action {rule['action']} is not supported locally")
        expand_jobset(manifest)  # raises UnsupportedManifest for env it cannot resolve

    # -- read -----------------------------------------------------------

    def get_jobset(self, name: str) -> JobSetState | None:
        """Current state of a JobSet, or None if it does not exist.

        A JobSet whose supervisor died without reaching a terminal phase is
        reported Failed with reason SupervisorLost.
        """
        state = read_state(self.state_dir(name))
        if state is None or state.terminal:
            return state
        state.supervisor_pid = state.supervisor_pid or _read_pid(self.state_dir(name))
        if state.supervisor_pid and not pid_alive(state.supervisor_pid):
            state = read_state(self.state_dir(name))  # it may have finished between the two reads
            if state is not None and not state.terminal:
                state.phase = "Failed"
                state.reason = "SupervisorLost"
                log = self.state_dir(name) / "supervisor.log"
                state.message = f"the local supervisor (pid {state.supervisor_pid}) is gone; see {log}"
        return state

    def list_jobsets(self, labels: dict[str, str] | None = None) -> list[JobSetState]:
        """JobSets of this run whose labels include ``labels``."""
        found = []
        if not self.jobsets_dir.is_dir():
            return found
        for state_dir in sorted(self.jobsets_dir.iterdir()):
            if not (state_dir / "state.json").exists() or ".deleted-" in state_dir.name:
                continue
            state = self.get_jobset(state_dir.name)
            if state and all(state.labels.get(k) == v for k, v in (labels or {}).items()):
                found.append(state)
        return found

    def watch_state(self, watch: Watch, name: str) -> None:
        """(Re-)add to ``watch`` what changes when JobSet ``name``'s state does: its state directory's entries
        (``state.json`` replaced by the supervisor, :func:`.state.write_state`) and the JobSets directory's (the
        state directory created, or renamed away when the JobSet is replaced or deleted). Called before each read,
        so the state read is never older than the events that wake the next wait."""
        watch.add(self.jobsets_dir)
        watch.add(self.state_dir(name))

    def wait(
        self,
        name: str,
        predicate: Callable[[JobSetState], bool],
        timeout: float,
        poll: float = 0.5,
        on_poll: Callable[[JobSetState], None] | None = None,
    ) -> JobSetState:
        """Wait until ``predicate`` holds for the JobSet or it turns terminal, woken by its state changes.

        ``predicate`` reads the state it is given: what it might read elsewhere (a pod's log) wakes nothing, so a
        wait for a log line watches the log (as :func:`multislice.backends.local.inotify.wait_for` does).

        Event-driven (:mod:`.inotify`): each replacement of ``state.json`` and the end of the supervisor (a lost
        supervisor turns the JobSet Failed, ``SupervisorLost``, without a write) wakes the wait, which re-reads
        the state. ``poll`` is the fallback interval where inotify or pidfds are unavailable, seconds.

        Returns:
            The state that satisfied the predicate, or the terminal state.

        Raises:
            TimeoutError: neither happened within ``timeout`` seconds.
            KeyError: the JobSet does not exist.
        """
        deadline = time.monotonic() + timeout
        with Watch(fallback_seconds=poll) as watch:
            while True:
                self.watch_state(watch, name)
                state = self.get_jobset(name)
                if state is None:
                    raise KeyError(f"no JobSet {name} under {self.jobsets_dir}")
                if on_poll:
                    on_poll(state)
                if predicate(state) or state.terminal:
                    return state
                watch.add_process(state.supervisor_pid)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"JobSet {name} still {state.phase} after {timeout:.0f} s")
                watch.wait(left)

    def pod_log(self, name: str, job_index: int = 0, completion_index: int = 0, attempt: int | None = None) -> Path:
        """Log file of a pod (the leader by default) at an attempt (:attr:`.state.JobSetState.attempt`, the latest
        by default)."""
        state = self.get_jobset(name)
        if attempt is None:
            attempt = state.attempt if state else 0
        hostname = names.pod_hostname(name, job_index, completion_index)
        return self.state_dir(name) / "pods" / f"{hostname}.attempt-{attempt}.log"

    # -- delete ---------------------------------------------------------

    def delete_jobset(
        self, name: str, timeout: float = 60, owner: str | None = None, grace_seconds: float | None = None
    ) -> JobSetState | None:
        """Delete a JobSet: stop its supervisor and every pod. Its state and logs stay on disk.

        A deleted JobSet's name can be created again (the old state directory is
        kept, renamed ``<name>.deleted-<time>``). With ``owner`` (a pipeline run
        id), only a JobSet that run created is deleted: its recorded
        ``pipeline/runid`` is re-read under the name's lock, so a JobSet another
        run created under the same name after the caller listed it is left alone.
        With ``grace_seconds``, the supervisor gives its pods that long after
        SIGTERM before SIGKILL (:data:`.state.GRACE_FILE`), not the manifest's
        ``terminationGracePeriodSeconds``.

        Returns:
            The final state (phase Deleted); None if it does not exist, or is not ``owner``'s.
        """
        with self._name_lock(name):
            state = self.get_jobset(name)
            if state is None or (owner is not None and not owned_by(state, owner)):
                return None
            return self._delete_locked(name, state, timeout, grace_seconds)

    def _delete_locked(
        self, name: str, state: JobSetState, timeout: float, grace_seconds: float | None = None
    ) -> JobSetState:
        if state.phase == "Deleted":
            return state
        if state.terminal and state.reason != "SupervisorLost":
            # Finished: no process is left; record the deletion so the name can be reused.
            state.event("Deleted", f"deleted after it {state.phase.lower()} ({state.reason})")
            state.phase = "Deleted"
            state.finished_at = state.finished_at or time.time()
            write_state(self.state_dir(name), state)
            return state
        if pid_alive(state.supervisor_pid):
            if grace_seconds is not None:
                (self.state_dir(name) / GRACE_FILE).write_text(f"{max(0.0, grace_seconds):g}", encoding="ascii")
            os.kill(state.supervisor_pid, signal.SIGTERM)
            try:
                final = self.wait(name, lambda s: s.terminal, timeout=timeout, poll=0.2)
            except TimeoutError:
                pass
            else:
                if final.reason != "SupervisorLost":
                    return final
                state = final  # it died before it stopped anything (SIGTERM before its handler): as below
        # The supervisor is gone or stuck: stop what it started ourselves.
        for pod in state.pods:
            if pod.phase == "Running" and pod.pid:
                try:
                    os.killpg(pod.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if state.supervisor_pid and pid_alive(state.supervisor_pid):
            os.kill(state.supervisor_pid, signal.SIGKILL)
        state.phase = "Deleted"
        state.reason = "Deleted"
        state.message = "deleted; its supervisor was gone or did not stop, so its pods were killed directly"
        state.finished_at = time.time()
        state.event("Deleted", state.message)
        write_state(self.state_dir(name), state)
        return state
