"""A pre-started pod interpreter (a *spare*) of the local backend: it imports a pod's modules ahead, then runs the pod.

A restart of a local JobSet starts every pod again, and each new trainer
process spends seconds to tens of seconds importing JAX and MaxText before it
trains (docs/reliability.md). The local supervisor
(:mod:`multislice.backends.local.spares`) therefore keeps, for each pod of the
next restart attempt, an interpreter that has already done the pod's imports::

    python -m multislice.trainer.spare MODULE [ARG ...]

started with the environment that pod will have (the variables JAX reads at
import, ``JAX_PLATFORMS``, ``XLA_FLAGS`` ... are already the pod's) and its
working directory. It imports ``MODULE`` and calls its ``warm_up(args)``
where it has one (:func:`multislice.trainer.worker.warm_up`: the worker's
imports, no JAX backend), writes :data:`READY` to its own log, and waits on
standard input. When the attempt starts, the supervisor writes one JSON line
(:func:`activation_message`): the pod's full environment (the run-time values
that differ from the spare's, the JAX coordinator port, are set then), its
working directory and its log. The spare then becomes the pod: standard output
and error go to the pod's log, standard input is ``/dev/null``, and ``MODULE``
runs as ``__main__`` with ``ARG ...`` as its arguments, as ``python -m MODULE
ARG ...`` would run it. Its pid, process group, exit code
and log are the pod's. End of input without a message (the supervisor
discarded it) ends the spare with status 0.

A spare runs at the pod's priority. A lower one would have to be its
session's: with the kernel's autogroups (``sched(7)``, on here) each session
is a scheduling group of its own, and a thread's nice value counts only
against the threads of its own session, so a spare with niced threads still
competes with each pod as an equal (measured in a profiling kill soak: spares
whose threads ran at nice 19 imported in about 50 s beside the training pods,
as the spares at the pods' priority did in the next). A niced
autogroup would take only what the pods leave idle, which on this machine's
two loaded cores is little: estimated, not measured, minutes for the imports
against tens of seconds between the kill soak's kills, so the spares would
mostly not be ready when needed.

The pod's code can ask whether it runs in a spare and when it became the pod
(:func:`activation`). Stdlib only at import.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

#: The line a spare writes to its own log once ``MODULE`` is imported and warmed up (then its pid, its seconds).
READY = "multislice spare: ready"


@dataclass(frozen=True)
class Activation:
    """When this process, a spare, became its pod.

    Attributes:
        started: ``time.monotonic()`` when the spare's interpreter began its warm-up, seconds.
        warmed: ``time.monotonic()`` when its warm-up (imports) ended, seconds; None if the pod started first.
        activated: ``time.monotonic()`` when it became the pod, seconds.
    """

    started: float
    warmed: float | None
    activated: float

    def seconds_since_pod_start(self) -> float:
        """Seconds since this process became the pod (the pod's start on the local backend)."""
        return time.monotonic() - self.activated


_activation: Activation | None = None


def activation() -> Activation | None:
    """How this process became its pod, when it is a spare that did; None for a pod started as a new process."""
    return _activation


def activation_message(env: dict[str, str], cwd: str, log: str) -> bytes:
    """The line the supervisor writes to a spare's standard input to make it the pod.

    Args:
        env: The pod's whole environment (replaces the spare's).
        cwd: The pod's working directory.
        log: The pod's log file (opened for appending; standard output and error go there).
    """
    return (json.dumps({"env": env, "cwd": cwd, "log": log, "at": time.time()}) + "\n").encode()


def _read_message() -> dict[str, Any] | None:
    """The activation message from standard input, or None at end of input (discarded)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        line += chunk
    return json.loads(line)


class _Listener(threading.Thread):
    """Waits for the activation message beside the warm-up (the pod may start before the imports end: it then
    counts from the message). End of input ends the process (a discarded spare)."""

    def __init__(self) -> None:
        super().__init__(name="multislice-spare-listener", daemon=True)
        self.message: dict[str, Any] | None = None
        self.activated = 0.0
        self.arrived = threading.Event()

    def run(self) -> None:
        message = _read_message()
        if message is None:
            os._exit(0)  # discarded: nothing of a pod ran here
        # The pod started when the supervisor sent the message (its clock; the read may come later).
        self.activated = time.monotonic() - max(0.0, time.time() - float(message.get("at", time.time())))
        self.message = message
        self.arrived.set()


def _become_pod(message: dict[str, Any]) -> None:
    """Standard streams, directory and environment of the pod (see the module's docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])


def main(argv: list[str] | None = None) -> None:
    """``python -m multislice.trainer.spare MODULE [ARG ...]``: warm up, wait, become the pod (module docstring)."""
    global _activation
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m multislice.trainer.spare MODULE [ARG ...]", file=sys.stderr)
        raise SystemExit(2)
    module, module_args = args[0], args[1:]
    started = time.monotonic()
    listener = _Listener()
    listener.start()
    warm_up = getattr(importlib.import_module(module), "warm_up", None)
    if warm_up is not None:
        warm_up(module_args)
    warmed = time.monotonic()
    if not listener.arrived.is_set():
        print(f"{READY}: pid {os.getpid()}, {module} imported in {warmed - started:.1f} s", flush=True)
    listener.arrived.wait()
    message = listener.message
    assert message is not None  # set before the event
    _become_pod(message)
    _activation = Activation(
        started=started,
        warmed=warmed if warmed <= listener.activated else None,
        activated=listener.activated,
    )
    sys.argv = [module, *module_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run as this package's module, not as ``__main__``: the pod's code reads :func:`activation` from it.
    from multislice.trainer import spare

    spare.main()
