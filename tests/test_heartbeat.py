"""multislice.heartbeat: a line after each ``every`` seconds of silence, driven by a fake clock and stop event."""

from __future__ import annotations

import threading
from collections.abc import Callable

from multislice.heartbeat import Heartbeat, elapsed_text, heartbeat


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedStop:
    """The beating thread's stop event: each scripted wait runs its action (default: the clock moves by the
    timeout, as a real wait that times out would) and times out; then it waits for the real ``set``."""

    def __init__(self, clock: Clock, script: list[Callable[[float], None] | None]) -> None:
        self.clock, self.script, self.real, self.timeouts = clock, list(script), threading.Event(), []

    def wait(self, timeout: float | None = None) -> bool:
        if self.script:
            action = self.script.pop(0)
            self.timeouts.append(timeout)
            if action is None:
                self.clock.now += timeout or 0.0
            else:
                action(timeout or 0.0)
            return False
        return self.real.wait()

    def set(self) -> None:
        self.real.set()


def test_a_silent_wait_beats_every_interval_with_what_runs_and_the_elapsed_time():
    clock, told = Clock(), []
    stop = ScriptedStop(clock, [None, None, None])
    with heartbeat("AOT-compiling stage tiny for 1 x v6e-16", told.append, 30, clock=clock, stop=stop) as beat:
        pass
    assert told == [
        "AOT-compiling stage tiny for 1 x v6e-16: 30 s so far",
        "AOT-compiling stage tiny for 1 x v6e-16: 1 min 00 s so far",
        "AOT-compiling stage tiny for 1 x v6e-16: 1 min 30 s so far",
    ]
    assert stop.timeouts == [30, 30, 30] and beat.beats == 3


def test_a_line_told_through_it_restarts_the_silence_and_detail_and_phase_are_shown():
    clock, told = Clock(), []
    holder = {}

    def line_at_20(timeout: float) -> None:
        clock.now += 20
        holder["beat"].tell("  Resolved 312 packages in 40ms")
        clock.now += timeout - 20

    def new_phase(timeout: float) -> None:
        holder["beat"].phase("installing")
        clock.now += timeout

    stop = ScriptedStop(clock, [line_at_20, None, new_phase])
    holder["beat"] = beat = Heartbeat("uv pip sync", told.append, 30, detail=lambda: "3 of 312 packages",
                                      clock=clock, stop=stop)  # fmt: skip
    beat.start()
    beat.close()
    # 20 s: uv's line; 30 s: no beat (10 s since that line); 50 s and 80 s: beats
    assert told == [
        "  Resolved 312 packages in 40ms",
        "uv pip sync: 50 s so far; 3 of 312 packages",
        "installing: 1 min 20 s so far; 3 of 312 packages",
    ]
    assert stop.timeouts == [30, 20, 30]


def test_no_beat_after_the_block_ends_and_a_fast_block_gets_none():
    told = []
    with heartbeat("quick", told.append, 30):  # a real event and clock: the block ends long before 30 s
        pass
    assert told == []


def test_elapsed_text():
    assert [elapsed_text(s) for s in (0, 59.9, 60, 125, 3600, 3725)] == [
        "0 s", "59 s", "1 min 00 s", "2 min 05 s", "1 h 00 min", "1 h 02 min",
    ]  # fmt: skip
