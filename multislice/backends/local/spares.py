"""Pre-started pod interpreters ("spares") for the next restart attempt of a local JobSet.

A restart of a local JobSet starts each pod as a new process, and a trainer
pod then spends seconds to tens of seconds importing JAX and MaxText before it
trains (under load on this machine, most of a restart: docs/reliability.md).
While an attempt runs, the supervisor (:mod:`.supervisor`) keeps one *spare*
per pod of the next attempt: ``python -m multislice.trainer.spare MODULE ARG
...`` (:mod:`multislice.trainer.spare`), started with that pod's environment
(``expand_jobset(restart_attempt=N + 1)``: every variable JAX reads at import
is already the pod's), its working directory and the same ``die_with_parent``
and new session as a pod, its output in ``spares/<hostname>.attempt-<N+1>.log``
of the JobSet's state directory. It imports the pod's module and waits, at a
lower priority where it can restore it (:data:`multislice.trainer.spare.NICE`).

When the attempt starts, :meth:`Spares.launch` hands each pod to its spare
(the pod's environment, directory and log through the spare's standard input)
when the spare is alive and was started with the same command, directory and
environment, except the values only known at the start (:data:`RUNTIME_ENV`:
the JAX coordinator port the supervisor picks per attempt). Otherwise, or for a
pod whose command is not a warmable module (``python -m <module>`` with the
module in :func:`warmable_modules`: the trainer worker), the pod starts as a
new process exactly as before. Either way the process is the supervisor's child
and the pod's pid, process group, exit code and log are what they were.

Spares are never pods: they are not in ``state.json``, and whatever ends an
attempt, the JobSet or the supervisor stops them (:meth:`Spares.stop`; a
SIGKILLed supervisor's spares die with it). A spare only ever becomes a pod of
its own JobSet: each supervisor keeps its own.

What a cluster does differently: a restarted JobSet's pods are new pods (the
JobSet controller recreates the child Jobs), scheduled, their image pulled or
cached, their containers started: nothing is pre-started. The goodput model
(docs/goodput.md) prices that restart; docs/testing.md says what this backend
does not model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multislice import maxtext
from multislice.backends.local.pods import LocalPod
from multislice.cancel import die_with_parent
from multislice.trainer import spare

#: The supervisor's environment variable naming the modules whose pods get spares, comma-separated (default: the
#: trainer worker); ``off`` (or empty) starts every pod as a new process. Tests name their stand-in pod's module.
ENV_SPARES = "MULTISLICE_LOCAL_SPARES"
#: Pod environment variables whose values are known only when the attempt starts: they may differ between a spare
#: and its pod, and reach the pod with the rest of its environment at activation (JAX reads them later).
RUNTIME_ENV = frozenset({maxtext.ENV_COORDINATOR_PORT})


def warmable_modules(environ: dict[str, str] | os._Environ = os.environ) -> frozenset[str]:
    """The modules whose pods get spares: :data:`ENV_SPARES`, or the trainer worker when it is unset."""
    value = environ.get(ENV_SPARES)
    if value is None:
        return frozenset({maxtext.WORKER_MODULE})
    if value.strip().lower() in ("", "off", "0", "false"):
        return frozenset()
    return frozenset(m.strip() for m in value.split(",") if m.strip())


def warmable(argv: list[str], modules: frozenset[str]) -> bool:
    """Whether a pod's command is ``<python> -m <module> ...`` with ``module`` among ``modules``."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in modules


@dataclass
class Spare:
    """A pre-started interpreter for one pod of the next attempt.

    Attributes:
        hostname: The pod it is for.
        attempt: The restart attempt it is for.
        argv: The pod's command (the spare runs ``argv[0] -m multislice.trainer.spare argv[2:]``).
        env: The environment it was started with (the pod's, at that attempt, with its manifest values).
        cwd: Its working directory.
        proc: The process.
        log: Its own log until it becomes the pod.
    """

    hostname: str
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    proc: subprocess.Popen
    log: Path


def _differing(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


class Spares:
    """The spares of one JobSet's supervisor, for its next attempt.

    Args:
        log_dir: Where each spare logs until it becomes a pod (``<state dir>/spares``).
        modules: The pod modules that get spares (:func:`warmable_modules`).
    """

    def __init__(self, log_dir: Path, modules: frozenset[str]):
        self.log_dir = log_dir
        self.modules = modules
        self.waiting: dict[str, Spare] = {}

    def start(self, pods: list[LocalPod], attempt: int, env_of: Callable[[LocalPod], dict[str, str]], cwd: Path) -> int:
        """Start a spare for each pod of ``attempt`` whose command is warmable; returns how many were started.

        ``pods`` are ``expand_jobset(restart_attempt=attempt)``'s; ``env_of`` gives a pod's whole environment as the
        supervisor would start it. Spares of another attempt still waiting are stopped first.
        """
        self.stop()
        if not self.modules:
            return 0
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for pod in pods:
            if not warmable(pod.argv, self.modules):
                continue
            env = env_of(pod)
            log_path = self.log_dir / f"{pod.hostname}.attempt-{attempt}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    [pod.argv[0], "-m", spare.__name__, *pod.argv[2:]],
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # as a pod: its pid is its process group's id
                    preexec_fn=die_with_parent(),  # a SIGKILLed supervisor's spares die with it
                )
            self.waiting[pod.hostname] = Spare(pod.hostname, attempt, list(pod.argv), env, str(cwd), proc, log_path)
        return len(self.waiting)

    def take(self, hostname: str, attempt: int, argv: list[str], env: dict[str, str], cwd: Path) -> Spare | None:
        """The waiting spare that can become this pod, or None (none, dead, or started for something else: then
        stopped). A spare matches when it is alive and was started for this pod and attempt, with this command
        and directory, and an environment that differs from ``env`` only in :data:`RUNTIME_ENV`."""
        found = self.waiting.pop(hostname, None)
        if found is None:
            return None
        same = (
            found.attempt == attempt
            and found.argv == argv
            and found.cwd == str(cwd)
            and _differing(found.env, env) <= RUNTIME_ENV
        )
        if same and found.proc.poll() is None:
            return found
        _kill(found)
        return None

    def launch(
        self, hostname: str, attempt: int, argv: list[str], env: dict[str, str], cwd: Path, log: Path
    ) -> tuple[subprocess.Popen, bool]:
        """Start a pod: in its spare when one matches (:meth:`take`), else as a new process as before.

        Returns:
            ``(process, from_spare)``: the pod's process (a child of this process, in a session of its own,
            ``die_with_parent``), and whether it is a spare that became the pod.
        """
        found = self.take(hostname, attempt, argv, env, cwd)
        if found is not None:
            try:
                assert found.proc.stdin is not None
                found.proc.stdin.write(spare.activation_message(env, str(cwd), str(log)))
                found.proc.stdin.close()
                return found.proc, True
            except (BrokenPipeError, OSError):  # it died since: as if there were none
                _kill(found)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # a SIGKILLed supervisor's pods die with it
            )
        return proc, False

    def stop(self) -> None:
        """Stop every waiting spare (SIGKILL to its process group: it holds nothing) and reap it."""
        waiting, self.waiting = list(self.waiting.values()), {}
        for found in waiting:
            _kill(found)

    def pids(self) -> list[int]:
        """The pids of the waiting spares."""
        return [s.proc.pid for s in self.waiting.values()]


def _kill(found: Spare) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(found.proc.pid, signal.SIGKILL)
    if found.proc.stdin is not None:
        with contextlib.suppress(OSError):
            found.proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL: it ends at once (a zombie stays at worst)
        found.proc.wait(timeout=10)
