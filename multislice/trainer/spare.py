"""A pre-started pod interpreter of the local backend: a *fork server* that imports a pod's modules once, then forks
each pod of the JobSet's later attempts from it.

A restart of a local JobSet starts every pod again, and each new trainer
process spends seconds to tens of seconds importing JAX and MaxText before it
trains (docs/reliability.md). The local supervisor
(:mod:`multislice.backends.local.spares`) therefore keeps, while a restart can
follow, one interpreter per JobSet that has already done the pods' imports::

    python -m multislice.trainer.spare MODULE [ARG ...]

started with a pod's environment (the variables JAX reads at import,
``JAX_PLATFORMS``, ``XLA_FLAGS`` ... are the pods') and working directory. It
imports ``MODULE`` and calls its ``warm_up(args)`` where it has one
(:func:`multislice.trainer.worker.warm_up`: the worker's imports, no JAX
backend), writes :data:`READY` to its log, and answers on its standard output,
one JSON line per request read from its standard input:

- first ``{"ready": true, "pid": P, "seconds": S}`` once warmed up;
- then, for each request (:func:`fork_request`: a pod's environment, working
  directory, log and the supervisor's pid), ``{"pid": N}``: the pod, forked
  from this warmed interpreter (or ``{"error": "..."}``).

A pod is forked twice, so that it is the *supervisor's* child, as a pod
started as a new process is: the supervisor is a child subreaper
(``PR_SET_CHILD_SUBREAPER``, Linux ``prctl(2)``), the intermediate child
exits at once, and the kernel reparents the pod to the supervisor, which then
reaps it and reads its exit status. Only after this server has reaped the
intermediate does the pod go on (a pipe, no delay). It starts a session of its
own (its pid is its process group's, as a pod's) before it tells the server its
pid, so stopping the server never reaches it; it asks for SIGKILL when the
supervisor ends (``PR_SET_PDEATHSIG``), takes the pod's log as standard output
and error and ``/dev/null`` as standard input, its directory and its whole
environment, and runs ``MODULE`` as ``__main__`` with ``ARG ...`` as its
arguments, as ``python -m MODULE ARG ...`` would, ending the process as that
would (``atexit`` handlers run). The pod's own pid, process group, exit status
and log are what they would be in a process of its own.

The imports are paid once per supervisor, not once per pod and attempt: a
pre-started interpreter per pod of the next attempt, the design this replaced,
imported beside the running attempt at every restart (about 52 s of CPU on the
kill soak's four pods, on 2 cores), which slowed the attempt it was to replace.
The forked pods share the server's memory pages until they write them.

A fork keeps only the calling thread. This server starts none, and its imports
leave one idle daemon thread (``google_cloud_mldiagnostics``' metrics flusher,
waiting on its queue, which MaxText feeds only with ``managed_mldiagnostics``);
the pod starts no JAX backend before it forks (``warm_up`` checks it), so
``jax.distributed`` initialises in the pod as in a new process.

The pod's code can ask whether it was forked from a pre-started interpreter
and when (:func:`activation`). End of input ends the server with status 0.
Stdlib only at import.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

#: The line the server writes to its log once ``MODULE`` is imported and warmed up (then its pid, its seconds).
READY = "multislice spare: ready"
#: ``prctl(2)`` option: the signal this process gets when its parent ends.
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Activation:
    """When this process, a pod, was forked from a pre-started interpreter.

    Attributes:
        started: ``time.monotonic()`` when the interpreter began its warm-up, seconds.
        warmed: ``time.monotonic()`` when its warm-up (imports) ended, seconds.
        activated: ``time.monotonic()`` when the pod was forked from it (the pod's start), seconds.
    """

    started: float
    warmed: float | None
    activated: float

    def seconds_since_pod_start(self) -> float:
        """Seconds since this process became the pod (the pod's start on the local backend)."""
        return time.monotonic() - self.activated


_activation: Activation | None = None


def activation() -> Activation | None:
    """How this process became its pod, when it was forked from a pre-started interpreter; None for a pod started
    as a new process."""
    return _activation


def fork_request(env: dict[str, str], cwd: str, log: str, parent: int) -> bytes:
    """The line the supervisor writes to the server's standard input to fork a pod.

    Args:
        env: The pod's whole environment (replaces the server's in the pod).
        cwd: The pod's working directory.
        log: The pod's log file (opened for appending; standard output and error go there).
        parent: The supervisor's pid: the pod's parent once reparented (it must be a child subreaper).
    """
    return (json.dumps({"env": env, "cwd": cwd, "log": log, "parent": parent}) + "\n").encode()


class _Lines:
    """JSON lines from a file descriptor (the supervisor's requests)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""

    def next(self) -> dict[str, Any] | None:
        """The next request, or None at end of input."""
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _answer(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _fork_pod(request: dict[str, Any], requests: _Lines, answers: int) -> dict[str, Any] | None:
    """Fork the pod twice (see the module's docstring). Returns the request in the pod, None in the server (which
    has answered with the pod's pid or an error)."""
    go_read, go_write = os.pipe()  # the pod waits on it until its intermediate parent has been reaped
    pid_read, pid_write = os.pipe()  # the pod tells its pid once in a session of its own
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(go_write)
            os.close(pid_read)
            pod = os.fork()
        except BaseException:
            os._exit(1)
        if pod == 0:
            # Its own session first, before the server answers: stopping the server (SIGKILL to its process
            # group) must never reach a pod it forked.
            os.setsid()
            os.write(pid_write, str(os.getpid()).encode())
            os.close(pid_write)
            os.read(go_read, 1)
            os.close(go_read)
            os.close(requests.fd)
            os.close(answers)
            return request
        os._exit(0)
    os.close(go_read)
    os.close(pid_write)
    told = b""
    while chunk := os.read(pid_read, 64):
        told += chunk
    os.close(pid_read)
    os.waitpid(intermediate, 0)  # the pod is now the supervisor's child (a child subreaper)
    try:
        os.write(go_write, b"1")
    except BrokenPipeError:  # the pod already died
        pass
    os.close(go_write)
    _answer(answers, {"pid": int(told)} if told else {"error": "the intermediate child could not fork the pod"})
    return None


def _become_pod(request: dict[str, Any]) -> None:
    """Parent-death signal, standard streams, directory and environment of the pod (its session is its own)."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)
    if os.getppid() != int(request["parent"]):  # the supervisor ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def main(argv: list[str] | None = None) -> None:
    """``python -m multislice.trainer.spare MODULE [ARG ...]``: warm up, fork pods on request (module docstring)."""
    global _activation
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m multislice.trainer.spare MODULE [ARG ...]", file=sys.stderr)
        raise SystemExit(2)
    module, module_args = args[0], args[1:]
    started = time.monotonic()
    # Answers go to the supervisor's pipe, given as standard output; whatever the imports print goes to the log.
    answers = os.dup(1)
    os.dup2(2, 1)
    requests = _Lines(os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    warm_up = getattr(importlib.import_module(module), "warm_up", None)
    if warm_up is not None:
        warm_up(module_args)
    warmed = time.monotonic()
    # The answer first: once the log says ready, the supervisor can read that it is.
    _answer(answers, {"ready": True, "pid": os.getpid(), "seconds": round(warmed - started, 2)})
    print(f"{READY}: pid {os.getpid()}, {module} imported in {warmed - started:.1f} s", flush=True)
    while True:
        request = requests.next()
        if request is None:
            return  # the supervisor closed the pipe: nothing more to fork
        pod = _fork_pod(request, requests, answers)
        if pod is not None:
            break
    _become_pod(pod)
    _activation = Activation(started=started, warmed=warmed, activated=time.monotonic())
    sys.argv = [module, *module_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run as this package's module, not as ``__main__``: the pod's code reads :func:`activation` from it.
    from multislice.trainer import spare

    spare.main()
