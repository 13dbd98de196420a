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
