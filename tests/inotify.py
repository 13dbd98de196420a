"""Wait for a file to appear, on inotify events (Linux ``inotify(7)``), with no polling interval.

The standard library has no inotify binding; this is the few calls the tests need, through libc
(``inotify_init1``, ``inotify_add_watch``; the event layout of ``struct inotify_event`` in ``inotify(7)``).
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
IN_CLOEXEC = os.O_CLOEXEC
IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


def wait_for_glob(root: Path, pattern: str, timeout: float, pidfd: int | None = None) -> bool:
    """True once a path matching ``root.glob(pattern)`` exists; False after ``timeout`` seconds, or as soon as
    the process of ``pidfd`` has exited. Every directory under ``root`` is watched, new ones as they appear (each
    is watched before it is listed, so nothing created between the two is missed)."""
    fd = _libc.inotify_init1(IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    watched: dict[int, Path] = {}

    def watch(directory: Path) -> None:
        for current, _dirs, _files in os.walk(directory):
            wd = _libc.inotify_add_watch(fd, os.fsencode(current), IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE)
            if wd >= 0:  # a directory gone meanwhile is no longer of interest
                watched[wd] = Path(current)

    try:
        watch(root)
        deadline = time.monotonic() + timeout
        while not any(root.glob(pattern)):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd] + ([pidfd] if pidfd is not None else []), [], [], left)
            if pidfd is not None and pidfd in ready:
                return any(root.glob(pattern))
            if fd not in ready:
                continue
            data, offset = os.read(fd, 65536), 0
            while offset < len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if mask & IN_ISDIR and wd in watched:
                    watch(watched[wd] / os.fsdecode(name))
        return True
    finally:
        os.close(fd)
