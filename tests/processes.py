"""Wait for processes to end on their pidfds (the kernel's exit event), never on a fixed sleep.

Stdlib only: the trainer-environment scripts of the tests import it too (with the checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable


def wait_gone(find: Callable[[], list[int]], timeout: float) -> list[int]:
    """Wait until ``find()`` (the pids of a group of processes) is empty, or ``timeout`` seconds pass; returns what
    is left.

    Each found process's pidfd (``os.pidfd_open``) becomes readable when it exits: this waits on those events, then
    looks again (a process may have started another before it ended), until none is found.
    """
    deadline = time.monotonic() + timeout
    while (found := find()) and (left := deadline - time.monotonic()) > 0:
        fds = []
        for pid in found:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:  # already gone: look again
                pass
        try:
            if fds:
                select.select(fds, [], [], left)  # returns at the first exit; the loop looks again
        finally:
            for fd in fds:
                os.close(fd)
    return find()


def spare_pids(state_dir: str | os.PathLike[str]) -> list[int]:
    """Pids of live fork servers (``multislice.trainer.spare``, the local backend's pre-started interpreter) of a
    JobSet: processes in its state directory (their working directory) whose standard error is a log under its
    ``spares/``, read from ``/proc``. The pods they forked run the same command there, but log to ``pods/``."""
    found = []
    logs = os.path.join(os.fspath(state_dir), "spares", "")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().split(b"\0")
            cwd = os.readlink(f"/proc/{entry}/cwd")
            stderr = os.readlink(f"/proc/{entry}/fd/2")
            with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        server = b"multislice.trainer.spare" in cmdline and stderr.startswith(logs)
        if server and cwd == os.fspath(state_dir) and not zombie:
            found.append(int(entry))
    return found
