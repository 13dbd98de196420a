"""Waiting on the local backend's files and processes as events: inotify(7) for files, pidfd_open(2) for processes.

The local "controllers" (a JobSet's supervisor, :mod:`.supervisor`; the capacity model, :mod:`.capacity`) publish
their state in files, replaced atomically (``os.replace``: ``IN_MOVED_TO`` on the directory), and the steps wait on
them. :class:`Watch` turns that into events, as a Kubernetes watch does on GKE: a waiter adds its directories and
files (and the processes whose end matters, as pidfds), re-reads what it waits for, and blocks in
:meth:`Watch.wait` until something changed, the process ended, or its deadline. Added before the state is read,
a watch misses nothing that happens after the read.

The standard library has no inotify binding; this is the few calls needed, through libc (``inotify_init1``,
``inotify_add_watch``; the layout of ``struct inotify_event`` in ``inotify(7)``), and :func:`os.pidfd_open`
(Linux 5.3, Python 3.9).

Fallback: where inotify is unavailable (not Linux, no such libc symbol, or ``inotify_init1`` refused: EMFILE when
``fs.inotify.max_user_instances``, 128 by default, is used up; ENOSYS), or a watch cannot be added (ENOSPC:
``fs.inotify.max_user_watches``), :meth:`Watch.wait` returns after at most ``fallback_seconds`` and the caller
re-reads, i.e. it polls at that interval (the backend's ``timings.poll_seconds``). A process whose pidfd cannot be
opened (``pidfd_open`` missing, or the process is not ours to see) is handled the same way. :attr:`Watch.polling`
says which case holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import struct
import time
from collections.abc import Callable
from pathlib import Path

#: ``inotify(7)`` event bits.
IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_IGNORED, IN_ISDIR = 0x8000, 0x40000000
#: What a state directory's waiter needs: an entry replaced (``os.replace``), created, written or removed, and the
#: directory itself renamed or removed (a JobSet replaced or deleted keeps its state aside under another name).
DIRECTORY_EVENTS = IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
#: What a log follower needs of a file: it grew (or was closed after writing).
FILE_EVENTS = IN_MODIFY | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "inotify_init1") and hasattr(libc, "inotify_add_watch") else None


_LIBC = _libc()


class Watch:
    """An inotify instance and a set of pidfds; :meth:`wait` blocks until one of them has news, or a timeout.

    Use as a context manager (closes its file descriptors). Every path is watched by inode: a directory renamed
    away is not followed by name; call :meth:`add` again on each re-read (it is idempotent and cheap) to watch
    whatever is at the path now.

    Args:
        fallback_seconds: The longest :meth:`wait` blocks when it cannot be woken by an event (the fallback,
            :attr:`polling`), seconds.
    """

    def __init__(self, fallback_seconds: float):
        self.fallback_seconds = fallback_seconds
        self.fd: int | None = None
        self.polling = _LIBC is None  #: True when some change cannot wake :meth:`wait` (it then polls)
        self.events = 0  #: inotify events read so far (tests, benchmarks)
        self._pidfds: dict[int, int] = {}  # pid -> pidfd
        self._ended: set[int] = set()  # pids whose pidfd could not be opened because they are gone
        self._borrowed: set[int] = set()  # pidfds the caller opened (and closes)
        self._wakeups: list[int] = []  # non-blocking read ends the caller writes to (signal.set_wakeup_fd)
        if _LIBC is not None:
            fd = _LIBC.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
            if fd < 0:
                self.polling = True
            else:
                self.fd = fd

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the inotify instance and every pidfd."""
        for pidfd in self._pidfds.values():
            if pidfd not in self._borrowed:
                os.close(pidfd)
        self._pidfds.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def add(self, path: str | Path, mask: int = DIRECTORY_EVENTS) -> bool:
        """Watch ``path`` (a directory's entries, or a file) for the events of ``mask``; False when it does not
        exist (nothing to watch yet: the caller watches its parent for its creation) or cannot be watched (then
        :attr:`polling`)."""
        if self.fd is None or _LIBC is None:
            return os.path.exists(path)
        if _LIBC.inotify_add_watch(self.fd, os.fsencode(path), mask) >= 0:
            return True
        error = ctypes.get_errno()
        if error not in (errno.ENOENT, errno.ENOTDIR):
            self.polling = True  # ENOSPC (max_user_watches), EACCES ...
        return False

    def add_process(self, pid: int | None) -> bool:
        """Wake :meth:`wait` when process ``pid`` ends; True when it is watched (or already gone: the next wait
        returns at once). False (and :attr:`polling`) when its pidfd cannot be opened."""
        if not pid or pid in self._pidfds or pid in self._ended:
            return True
        try:
            self._pidfds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            self._ended.add(pid)
        except (OSError, AttributeError):
            self.polling = True
            return False
        return True

    def add_pidfd(self, pidfd: int) -> None:
        """Wake :meth:`wait` when the process of ``pidfd`` (the caller's, which it closes) ends."""
        self._pidfds[-pidfd - 1] = pidfd  # keyed apart from pids
        self._borrowed.add(pidfd)

    def add_wakeup(self, fd: int) -> None:
        """Wake :meth:`wait` whenever non-blocking ``fd`` (the caller's, e.g. the read end of a pipe given to
        :func:`signal.set_wakeup_fd`) has data; the data is read and discarded."""
        self._wakeups.append(fd)

    def wait(self, timeout: float) -> bool:
        """Block until an event on a watched path, a watched process's end, or ``timeout`` seconds (at most
        ``fallback_seconds`` while :attr:`polling`). Reads and discards the pending events: the caller re-reads
        the state it waits on. Returns True when woken by an event or a process's end."""
        if self._ended:  # a process added after it had ended: its end is news once
            self._ended.clear()
            return True
        if self.polling or (self.fd is None and not self._pidfds):
            timeout = min(timeout, self.fallback_seconds)
        fds = self._fds()
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            ready, _, _ = select.select(fds, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            woke = False
            for pid, pidfd in list(self._pidfds.items()):
                if pidfd in ready:  # the process ended: stop watching it, its end is news once
                    self._pidfds.pop(pid)
                    if pidfd not in self._borrowed:
                        os.close(pidfd)
                    woke = True
            for fd in self._wakeups:
                if fd in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(fd, 512):
                            pass
                    woke = True
            if self.fd is not None and self.fd in ready:
                woke = self._drain() or woke
            if woke:
                return True
            fds = self._fds()

    def _fds(self) -> list[int]:
        return ([self.fd] if self.fd is not None else []) + list(self._pidfds.values()) + self._wakeups

    def _drain(self) -> bool:
        """Read every pending inotify event; True when one of them was not just a watch being dropped."""
        assert self.fd is not None
        news = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return news
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                self.events += 1
                news = news or mask != IN_IGNORED


def wait_for[T](check: Callable[[], T], watch: Watch, timeout: float) -> T | None:
    """``check()``'s first truthy value, re-checked after each :meth:`Watch.wait`; None after ``timeout`` seconds.

    The caller adds the watches before calling, so a change after the first check wakes the wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        watch.wait(left)
