"""The local supervisor's pre-started pod interpreter: a fork server that starts a restarted JobSet's pods warm.

A restart of a local JobSet starts each pod as a new process, and a trainer
pod then spends seconds to tens of seconds importing JAX and MaxText before it
trains (under load on this machine, most of a restart: docs/reliability.md).
While an attempt runs and a restart could follow, the supervisor
(:mod:`.supervisor`) keeps one *fork server* per JobSet: ``python -m
multislice.trainer.spare MODULE ARG ...`` (:mod:`multislice.trainer.spare`),
started with the environment of the next attempt's first pod
(``expand_jobset(restart_attempt=N + 1)``: every variable JAX reads at import
is already the pods'), their working directory, ``die_with_parent`` and a
session of its own, its log in ``spares/fork-server.attempt-<N+1>.log`` of
the JobSet's state directory. It imports the pods' module once and waits.

When a later attempt starts, :meth:`Spares.launch` asks the server to fork
each pod (the pod's environment, directory and log in the request) when the
server is alive and warmed up, was started with the pod's command and
directory, and its environment differs from the pod's only in values that
identify the pod or are only known at the start (:data:`RUNTIME_ENV`, the
JAX coordinator port the supervisor picks per attempt; and the Downward API
variables of the manifest with ``HOSTNAME``, :func:`identity_env`), none of
which JAX reads at import. Otherwise, or for a pod whose command is not a
warmable module (``python -m <module>`` with the module in
:func:`warmable_modules`: the trainer worker), the pod starts as a new process
exactly as before. Either way the pod is the supervisor's child (a forked pod
is reparented to it: the supervisor is a child subreaper,
:func:`multislice.cancel.become_subreaper`), and its pid, process group, exit
code and log are a pod's: :class:`ForkedPod` reads its exit status as
``subprocess.Popen`` does.

The server is never a pod: it is not in ``state.json``, and it serves every
later attempt of its supervisor, so the imports are paid once per supervisor
(a supervisor started again after its loss starts its own). Whatever ends the
JobSet, the JobSet or the supervisor stops it (:meth:`Spares.stop`; a
SIGKILLed supervisor's server and forked pods die with it). It only ever forks
pods of its own JobSet.

What a cluster does differently: a restarted JobSet's pods are new pods (the
JobSet controller recreates the child Jobs), scheduled, their image pulled or
cached, their containers started: nothing is pre-started. The goodput model
(docs/goodput.md) prices that restart; docs/testing.md says what this backend
does not model.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from multislice import maxtext
from multislice.backends.local.pods import LocalPod
from multislice.cancel import become_subreaper, die_with_parent
from multislice.trainer import spare

#: The supervisor's environment variable naming the modules whose pods get a fork server, comma-separated
#: (default: the trainer worker); ``off`` (or empty) starts every pod as a new process. Tests name their stand-in
#: pod's module.
ENV_SPARES = "MULTISLICE_LOCAL_SPARES"
#: Pod environment variables whose values are known only when the attempt starts: they may differ between the
#: server and a pod, and reach the pod with the rest of its environment when it is forked (JAX reads them later).
RUNTIME_ENV = frozenset({maxtext.ENV_COORDINATOR_PORT})
#: Name prefixes of variables read at import (JAX's config flags, XLA's and TensorFlow's, libtpu's): a variable
#: whose value identifies the pod is never one of these, or the pod starts as a new process.
IMPORT_TIME_PREFIXES = ("JAX_", "XLA_", "TF_", "TPU_", "LIBTPU", "PYTHON")
#: Seconds to wait for the server's answer to a fork request (it forks at once once warmed up).
FORK_ANSWER_SECONDS = 30.0


def warmable_modules(environ: dict[str, str] | os._Environ = os.environ) -> frozenset[str]:
    """The modules whose pods get a fork server: :data:`ENV_SPARES`, or the trainer worker when it is unset."""
    value = environ.get(ENV_SPARES)
    if value is None:
        return frozenset({maxtext.WORKER_MODULE})
    if value.strip().lower() in ("", "off", "0", "false"):
        return frozenset()
    return frozenset(m.strip() for m in value.split(",") if m.strip())


def warmable(argv: list[str], modules: frozenset[str]) -> bool:
    """Whether a pod's command is ``<python> -m <module> ...`` with ``module`` among ``modules``."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in modules


def identity_env(manifest: dict[str, Any]) -> frozenset[str]:
    """The variables whose values identify a pod of this JobSet: ``HOSTNAME`` and the containers' Downward API
    variables (``valueFrom.fieldRef``: job index, completion index, restart attempt ...), less any named like a
    variable read at import (:data:`IMPORT_TIME_PREFIXES`)."""
    names = {"HOSTNAME"}
    for rj in manifest["spec"]["replicatedJobs"]:
        for container in rj["template"]["spec"]["template"]["spec"]["containers"]:
            names |= {e["name"] for e in container.get("env", []) if "fieldRef" in e.get("valueFrom", {})}
    return frozenset(n for n in names if not n.startswith(IMPORT_TIME_PREFIXES))


class PodProcess(Protocol):
    """What the supervisor uses of a pod's process: ``subprocess.Popen``'s, or a :class:`ForkedPod`'s."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedPod:
    """A pod forked by the fork server and reparented to this process (a child subreaper): ``poll`` and ``wait``
    reap it and give its exit status as ``subprocess.Popen`` does (negative: the signal that ended it).

    Args:
        pid: The pod's pid (this process's child).
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the pod has ended (it is reaped then), else None."""
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the pod's end (its pidfd), at most ``timeout`` seconds; its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout``.
        """
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        if timeout is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        pidfd = os.pidfd_open(self.pid)
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.returncode  # type: ignore[return-value]


@dataclass
class Server:
    """The fork server of one supervisor.

    Attributes:
        argv: The pods' command (the server runs ``argv[0] -m multislice.trainer.spare argv[2:]``).
        env: The environment it was started with (the first pod's of the attempt it was started for).
        identity: The variables that may differ between it and a pod (:func:`identity_env`, :data:`RUNTIME_ENV`).
        cwd: Its working directory.
        proc: The process; its standard input takes requests, its standard output gives answers.
        log: Its log.
        ready: Whether it has said it is warmed up.
    """

    argv: list[str]
    env: dict[str, str]
    identity: frozenset[str]
    cwd: str
    proc: subprocess.Popen
    log: Path
    ready: bool = False
    buffer: bytes = field(default=b"", repr=False)

    def answer(self, timeout: float) -> dict[str, Any] | None:
        """The server's next answer line, or None when none came within ``timeout`` seconds.

        Raises:
            EOFError: it closed its output (it ended).
        """
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            readable, _, _ = select.select([fd], [], [], timeout)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the fork server ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def warmed_up(self) -> bool:
        """Whether it is warmed up, without waiting (reads its first answer if it came)."""
        if not self.ready and self.proc.poll() is None:
            with contextlib.suppress(EOFError, ValueError):
                found = self.answer(0)
                self.ready = bool(found and found.get("ready"))
        return self.ready and self.proc.poll() is None


def _differing(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


class Spares:
    """The fork server of one JobSet's supervisor, for its later attempts.

    Args:
        log_dir: Where the server logs (``<state dir>/spares``).
        modules: The pod modules that get a fork server (:func:`warmable_modules`).
    """

    def __init__(self, log_dir: Path, modules: frozenset[str]):
        self.log_dir = log_dir
        self.modules = modules
        self.server: Server | None = None

    def start(
        self,
        pods: list[LocalPod],
        attempt: int,
        env_of: Callable[[LocalPod], dict[str, str]],
        cwd: Path,
        identity: frozenset[str] = frozenset({"HOSTNAME"}),
    ) -> int:
        """Start the fork server for ``attempt``'s pods unless one that can fork them runs; returns 1 when one
        was started now, else 0.

        ``pods`` are ``expand_jobset(restart_attempt=attempt)``'s; ``env_of`` gives a pod's whole environment as the
        supervisor would start it; ``identity`` the variables that may differ between pods (:func:`identity_env`).
        """
        first = next((p for p in pods if warmable(p.argv, self.modules)), None)
        if first is None:
            return 0
        server = self.server
        if server is not None and server.proc.poll() is None and server.argv == first.argv and server.cwd == str(cwd):
            return 0
        self.stop()
        become_subreaper()  # the pods it forks are reparented to this process, which reaps them
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = env_of(first)
        log_path = self.log_dir / f"fork-server.attempt-{attempt}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [first.argv[0], "-m", spare.__name__, *first.argv[2:]],
                env=env,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # its pid is its process group's: stopped as one
                preexec_fn=die_with_parent(),  # a SIGKILLed supervisor's server dies with it
            )
        self.server = Server(list(first.argv), env, identity | RUNTIME_ENV, str(cwd), proc, log_path)
        return 1

    def _fork(self, server: Server, env: dict[str, str], cwd: Path, log: Path) -> ForkedPod | None:
        """A pod forked by ``server``, or None (it is then stopped)."""
        assert server.proc.stdin is not None
        try:
            server.proc.stdin.write(spare.fork_request(env, str(cwd), str(log), os.getpid()))
            server.proc.stdin.flush()
            found = server.answer(FORK_ANSWER_SECONDS)
            if found is None or "pid" not in found:
                raise OSError(f"the fork server answered {found!r}")
            pod = ForkedPod(int(found["pid"]))
            pod.poll()  # ChildProcessError if it were not this process's child
            return pod
        except (OSError, EOFError, ValueError):  # ChildProcessError is an OSError
            self.stop()
            return None

    def launch(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> tuple[PodProcess, bool]:
        """Start a pod: forked by the fork server when it can fork it (module docstring), else as a new process.

        Returns:
            ``(process, from_spare)``: the pod's process (a child of this process, in a session of its own, killed
            when this process ends), and whether it was forked from the pre-started interpreter.
        """
        server = self.server
        if (
            server is not None
            and warmable(argv, self.modules)
            and server.argv == argv
            and server.cwd == str(cwd)
            and _differing(server.env, env) <= server.identity
            and server.warmed_up()
        ):
            forked = self._fork(server, env, cwd, log)
            if forked is not None:
                return forked, True
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
        """Stop the fork server (SIGKILL to its process group: it holds nothing; its pods have sessions of their
        own) and reap it."""
        server, self.server = self.server, None
        if server is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        for stream in (server.proc.stdin, server.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL: it ends at once (a zombie stays at worst)
            server.proc.wait(timeout=10)

    def pids(self) -> list[int]:
        """The fork server's pid, while it runs."""
        return [self.server.proc.pid] if self.server is not None and self.server.proc.poll() is None else []
