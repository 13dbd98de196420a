"""Cancellation: SIGTERM or SIGINT at any instant of a step, turned into an exception the step cleans up after.

A cancelled pipeline run reaches a step's process as SIGTERM: on Kubernetes the
kubelet sends the container's main process SIGTERM when its pod is deleted and
SIGKILL once ``terminationGracePeriodSeconds`` (default 30 s) has passed
(https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-termination);
a Ctrl-C in a terminal is SIGINT to the foreground process group. A step
calls :func:`install` (its component does, as the first statement of its body,
before anything can be created), and both signals then raise
:class:`Cancelled` (a ``KeyboardInterrupt``, so ``except Exception`` in a wait
loop does not swallow it) wherever the step is. Only the first signal raises:
while a step removes what it created, further signals are noted, not raised, so
the removal runs to its end. :func:`shielded` marks a block a signal must not
split (start a process, then record its id): a signal inside it is raised when
the block ends.

Processes the step starts that must not outlive it call :func:`die_with_parent`
in the child (``preexec_fn=die_with_parent()``): Linux's ``PR_SET_PDEATHSIG`` (``prctl(2)``) sends
them SIGKILL when the thread that started them exits, which covers the SIGKILL
no handler can catch.

A step of ``multislice run`` must not outlive the run's driver unnoticed: a SIGKILLed
driver runs no handler, and kfp.local's step processes (``sh -c ... python3 -m
kfp.dsl.executor_main``) would go on training headless. ``multislice run`` names
itself in ``MULTISLICE_DRIVER`` (:func:`driver_value`: its pid and start time, so a
reused pid is not mistaken for it); :func:`install` and the local JobSet
supervisor call :func:`watch_driver`, a thread that waits on the driver's pidfd
(the kernel reports its end, however it ends) and then sends this process
SIGTERM: the step cancels itself, and the supervisor deletes its JobSet, exactly
as on SIGTERM.

Tests drive a step to a named state with :func:`point`: with
``MULTISLICE_CANCEL_AT=<point>`` and ``MULTISLICE_CANCEL_FIFO=<fifo>`` in its
environment, the step writes the point's name to the FIFO when it gets there
(blocking until the test reads it) and then waits for a signal; without the
FIFO it sends itself SIGTERM there. Unset (production), a point does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Environment variable naming the cancel point a test wants a step stopped at.
ENV_POINT = "MULTISLICE_CANCEL_AT"
#: Environment variable naming the FIFO a step announces the point on.
ENV_FIFO = "MULTISLICE_CANCEL_FIFO"
#: Environment variable naming the ``multislice run`` driver of the steps (:func:`driver_value`).
ENV_DRIVER = "MULTISLICE_DRIVER"
#: The signals that cancel a step.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Programs that only wrap a step: kfp.local runs each lightweight component as ``sh -c "... && python3 -m
#: kfp.dsl.executor_main ..."`` (``kfp/local/subprocess_task_handler.py``), so the step is the shell's child.
WRAPPERS = frozenset({"sh", "dash", "bash"})
#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1


class Cancelled(KeyboardInterrupt):
    """A step got SIGTERM or SIGINT. ``signame``: which (``SIGTERM``, ``SIGINT``)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signame = signal.Signals(signum).name
        super().__init__(f"cancelled by {self.signame}")


class _State:
    installed = 0  # nesting depth of handling()
    previous: dict[int, Any] = {}
    cancelled: int | None = None  # the signal that cancelled this process, once one did
    shield = 0
    pending: int | None = None
    watched: str | None = None  # the driver this process watches (ENV_DRIVER's value), once it does


def _handler(signum: int, frame: Any) -> None:
    if _State.cancelled is not None:
        return  # already cancelling: let the removal finish
    if _State.shield:
        _State.pending = _State.pending or signum
        return
    _State.cancelled = signum
    raise Cancelled(signum)


def install() -> None:
    """Make SIGTERM and SIGINT raise :class:`Cancelled` in this process from now on (idempotent).

    For a process that runs one step (a pipeline task); code that shares its
    process with others uses :func:`handling`. Only the main thread can install
    signal handlers (:func:`signal.signal`).
    """
    if _State.installed:
        return
    _State.installed = 1
    _State.previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    watch_driver()


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Within this context SIGTERM and SIGINT raise :class:`Cancelled`; the previous handlers come back after.

    Nests (and nests inside :func:`install`): only the outermost context installs and restores.
    """
    outermost = not _State.installed
    if outermost:
        _State.previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    _State.installed += 1
    try:
        yield
    finally:
        _State.installed -= 1
        if outermost:
            for sig, previous in _State.previous.items():
                signal.signal(sig, previous)
            _State.cancelled = _State.pending = None


def cancelled() -> bool:
    """True once this process was cancelled (a signal raised :class:`Cancelled`)."""
    return _State.cancelled is not None


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A block a signal must not split: a SIGTERM or SIGINT inside it raises :class:`Cancelled` when it ends."""
    _State.shield += 1
    try:
        yield
    finally:
        _State.shield -= 1
        if not _State.shield and _State.pending is not None and _State.cancelled is None:
            signum, _State.pending = _State.pending, None
            _State.cancelled = signum
            raise Cancelled(signum)


def point(name: str) -> None:
    """A named state of a step at which a test may cancel it (see the module docstring); a no-op otherwise."""
    if os.environ.get(ENV_POINT) != name:
        return
    fifo = os.environ.get(ENV_FIFO)
    if not fifo:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    with open(fifo, "w", encoding="utf-8") as announce:  # blocks until the test opens it to read
        announce.write(name + "\n")
    while True:  # until the test's signal arrives: it raises Cancelled here, or ends the process by default
        signal.pause()


_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive this process's calling thread: SIGKILL when it ends.

    ``PR_SET_PDEATHSIG`` (Linux ``prctl(2)``): the signal is sent when the
    thread that created the child ends, and the setting survives ``execve``.
    A parent that died before the call is caught after it (the child was
    reparented by then): the child then kills itself.
    """
    parent = os.getpid()

    def preexec() -> None:
        if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _start_ticks(pid: int) -> str | None:
    """A process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields 3.. follow the command name's ")"; 22 is the 20th


def driver_value(pid: int | None = None) -> str:
    """:data:`ENV_DRIVER`'s value naming process ``pid`` (default this one): ``<pid>:<start time in ticks>``."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_ticks(pid)}"


def watch_driver() -> bool:
    """When :data:`ENV_DRIVER` names a driver, start a daemon thread that sends this process SIGTERM once the
    driver has ended (at once if it already has, or its pid is now another process's); idempotent.

    The thread blocks on the driver's pidfd (``pidfd_open(2)``: readable when the process ends, SIGKILL
    included), so no polling. Returns True when a driver is (now or already) watched.
    """
    value = os.environ.get(ENV_DRIVER, "")
    if not value or _State.watched == value:
        return bool(value)
    pid_text, _, ticks = value.partition(":")
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    _State.watched = value
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None
    if pidfd is not None and _start_ticks(pid) != ticks:  # the pid is reused: the driver is gone
        os.close(pidfd)
        pidfd = None

    def wait() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
            os.close(pidfd)
        # kfp.local reads a step's output through pipes the driver held: with it gone, a write would raise
        # BrokenPipeError in the middle of the cancellation. Such output has no reader left: it goes to /dev/null.
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
        os.close(null)
        with contextlib.suppress(OSError):
            print(
                f"multislice: the run's driver (multislice run, pid {pid}) has ended: cancelling as on SIGTERM",
                file=sys.stderr,
                flush=True,
            )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="multislice-driver-watch", daemon=True).start()
    return True


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (Linux ``/proc/<pid>/task/<tid>/children``); [] once it has exited."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def step_pids(pid: int) -> list[int]:
    """The step processes under ``pid``: its children, and for a child that is only a shell wrapping a step
    (:data:`WRAPPERS`), that shell and what it runs, recursively.

    A signal meant for a step sent to the shell alone leaves the step orphaned: dash does not pass SIGTERM on
    to the command it waits for. Processes a step starts itself (its pods) are not listed: the step cancels
    them.
    """
    found: list[int] = []
    for child in child_pids(pid):
        found.append(child)
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue
        if name in WRAPPERS:
            found += step_pids(child)
    return found
