"""A stand-in trainer pod for the tests of the local backend's pre-started interpreter (``multislice.backends.local
.spares``): run as ``python -m tests.spare_pod MODE`` (cold) or forked by the fork server (``python -m
multislice.trainer.spare tests.spare_pod MODE``), in the trainer environment with the checkout on ``PYTHONPATH``.
Stdlib only, but for ``tests.inotify`` (the release wait).

Like the worker (``multislice.trainer.worker``) it has a ``warm_up(args)`` the server calls before any pod starts,
and its one line says how it started: ``spare pod: pid P attempt N port Q prestarted B warmed-first B nice N
stdin PATH cwd PATH ppid P pgid G``.

Modes: ``wait-first-attempt`` (attempt 0 waits for SIGKILL, later attempts go on), ``wait-for-release PATH`` (every
attempt waits for the file ``PATH``, then exits 0), ``fail-warm-up`` (``warm_up`` raises:
the server dies before any pod starts), anything else exits 0 at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

#: ``time.monotonic()`` when :func:`warm_up` ended in this process; None where it did not run (a cold start).
WARMED: float | None = None


def warm_up(args: list[str]) -> None:
    """What the worker's warm-up stands for: this pod's imports, before its start."""
    global WARMED
    import json  # noqa: F401 (a module the pod imports ahead, as the worker imports JAX and MaxText)

    if args and args[0] == "fail-warm-up":
        raise RuntimeError("the stand-in's warm-up fails, as a spare whose imports break")
    WARMED = time.monotonic()


def main(args: list[str]) -> None:
    """The pod: say how it started, then act as its mode says."""
    from multislice.trainer import spare  # in the trainer environment, with the checkout on PYTHONPATH

    mode = args[0] if args else "exit"
    attempt = int(os.environ.get("RESTART_ATTEMPT", "0"))
    activated = spare.activation()
    print(
        f"spare pod: pid {os.getpid()} attempt {attempt} port {os.environ.get('JAX_COORDINATOR_PORT')} "
        f"prestarted {activated is not None} warmed-first {activated is not None and activated.warmed is not None} "
        f"nice {os.getpriority(os.PRIO_PROCESS, 0)} stdin {os.readlink('/proc/self/fd/0')} cwd {os.getcwd()} "
        f"ppid {os.getppid()} pgid {os.getpgid(0)}",
        flush=True,
    )
    if mode == "wait-first-attempt" and attempt == 0:
        while True:  # until the test's SIGKILL
            signal.pause()
    if mode == "wait-for-release":
        release = Path(args[1])  # the test creates it once it has seen what it waits for: woken by inotify
        from tests.inotify import wait_for_glob  # only in this mode: the other modes need no watch

        while not wait_for_glob(release.parent, release.name, timeout=3600):
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
