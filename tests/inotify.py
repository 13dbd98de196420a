"""Wait for a file to appear, on inotify events (Linux ``inotify(7)``), with no polling interval.

Built on the local backend's own watch (:class:`multislice.backends.local.inotify.Watch`), which the steps use to
wait on JobSet state files; this adds what the tests need: a glob under a tree whose directories appear as it
is waited on, and the end of the process that should make the file.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

from multislice.backends.local.inotify import DIRECTORY_EVENTS, IN_MODIFY, Watch, wait_for


def wait_for_glob(root: Path, pattern: str, timeout: float, pidfd: int | None = None) -> bool:
    """True once a path matching ``root.glob(pattern)`` exists; False after ``timeout`` seconds, or as soon as
    the process of ``pidfd`` has exited. Every directory under ``root`` is watched, new ones as they appear (each
    is watched before it is listed, so nothing created between the two is missed).

    Raises:
        OSError: inotify is unavailable here (the tests' waits need it: no polling fallback in tests).
    """
    with Watch(fallback_seconds=timeout) as watch:
        if watch.fd is None:
            raise OSError("inotify is unavailable: the tests wait on inotify events")
        if pidfd is not None:
            watch.add_pidfd(pidfd)
        deadline = time.monotonic() + timeout
        ended = False
        while True:
            for current, _dirs, _files in os.walk(root):  # watched before listed: nothing made meanwhile is missed
                watch.add(current)
            if any(root.glob(pattern)):
                return True
            left = deadline - time.monotonic()
            if ended or left <= 0:
                return False
            if watch.wait(left) and pidfd is not None:
                ended = _ended(pidfd)


def wait_for_text(path: Path, text: str, timeout: float) -> bool:
    """True once the file ``path`` holds ``text`` (a pod's log line); False after ``timeout`` seconds. Woken by its
    directory's events and the writes to its files (``IN_MODIFY``), so a log that grows is read again at once.

    Raises:
        OSError: inotify is unavailable here (the tests' waits need it: no polling fallback in tests).
    """
    with Watch(fallback_seconds=timeout) as watch:
        if watch.fd is None or not watch.add(path.parent, DIRECTORY_EVENTS | IN_MODIFY):
            raise OSError(f"cannot watch {path.parent} with inotify: the tests wait on inotify events")
        return bool(wait_for(lambda: path.exists() and text in path.read_text(errors="replace"), watch, timeout))


def _ended(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])
