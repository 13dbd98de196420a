"""A heartbeat for long waits: a line at least every ``every`` seconds while a command works and says nothing.

An AOT compile (5-13 min per stage on a loaded machine), an admission wait, the shard workers of a text
stage, an export check, an environment install: each can be silent for minutes while it works, and a user
cannot tell it from a hang. :func:`heartbeat` wraps such a wait: from a thread, it tells what is running and
for how long (``AOT-compiling stage tiny for 1 x v6e-16: 2 min 30 s so far``) whenever ``every`` seconds
pass with no other line told through it (:meth:`Heartbeat.tell`). Lines go to the caller's ``tell``
(the steps' ``[step stage] ...`` lines, or ``print``).

The clock and the stop event are parameters, so a test drives the beats without waiting.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

#: The longest a command may work without a line, seconds (issue 44: "no command silent for more than 30 s").
DEFAULT_EVERY = 30.0


class Stop(Protocol):
    """What the beating thread waits on (a :class:`threading.Event`, or a test's stand-in)."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def set(self) -> None: ...


def elapsed_text(seconds: float) -> str:
    """``45 s``, ``2 min 05 s``, ``1 h 02 min``: a duration for a progress line."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Heartbeat:
    """The beats of one wait; :func:`heartbeat` starts and stops it.

    Attributes:
        what: What is running, e.g. ``AOT-compiling stage tiny``; :meth:`phase` changes it.
        every: Seconds of silence before a beat.
    """

    def __init__(
        self,
        what: str,
        tell: Callable[[str], object],
        every: float = DEFAULT_EVERY,
        *,
        detail: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop: Stop | None = None,
    ) -> None:
        self.what = what
        self.every = every
        self._tell = tell
        self._detail = detail
        self._clock = clock
        self._stop: Stop = stop if stop is not None else threading.Event()
        self._lock = threading.Lock()
        self.started = clock()
        self._last = self.started
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="multislice-heartbeat", daemon=True)

    def tell(self, line: str) -> None:
        """Tell ``line`` (through the wrapped ``tell``); the silence the next beat waits for starts again."""
        with self._lock:
            self._last = self._clock()
            self._tell(line)

    def phase(self, what: str) -> None:
        """What the beats say runs from now on (the wait goes on; its elapsed time is not reset)."""
        self.what = what

    def line(self) -> str:
        """The beat's line: what runs, for how long, and the ``detail`` callback's words when it has some."""
        text = f"{self.what}: {elapsed_text(self._clock() - self.started)} so far"
        extra = self._detail() if self._detail else ""
        return f"{text}; {extra}" if extra else text

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._last + self.every - self._clock())):
            with self._lock:
                if self._clock() - self._last < self.every:
                    continue  # a line was told meanwhile
                self._last = self._clock()
                self.beats += 1
                self._tell(self.line())
                sys.stdout.flush()  # a tell that prints (print's default) reaches a pipe now, not at exit

    def start(self) -> None:
        """Start beating (from a daemon thread)."""
        self._thread.start()

    def close(self) -> None:
        """Stop beating; returns once the thread has ended (no beat is told after this returns)."""
        self._stop.set()
        self._thread.join()


@contextmanager
def heartbeat(
    what: str,
    tell: Callable[[str], object] = print,
    every: float | None = None,
    *,
    detail: Callable[[], str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    stop: Stop | None = None,
) -> Iterator[Heartbeat]:
    """Tell ``what: <elapsed> so far`` through ``tell`` after each ``every`` seconds of silence in the block.

    Lines the block tells through the yielded :meth:`Heartbeat.tell` reset the silence, so a wait that
    reports its own progress gets no extra lines.

    Args:
        what: What is running, as the beat names it.
        tell: Where lines go (``print``, or a step's :func:`multislice.steps.teller`).
        every: Seconds of silence before a beat (default :data:`DEFAULT_EVERY`, read at each call).
        detail: Called at each beat for more words (e.g. packages installed so far), or ``''``.
        clock, stop: The monotonic clock and the event the thread waits on (a test's stand-ins).
    """
    beat = Heartbeat(what, tell, DEFAULT_EVERY if every is None else every, detail=detail, clock=clock, stop=stop)
    beat.start()
    try:
        yield beat
    finally:
        beat.close()
