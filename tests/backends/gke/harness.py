"""The GKE scenarios' plain helpers: the run id, the node pools, and the controller script's waits.

The fixtures that serve the emulated cluster over HTTP are in tests/backends/gke/conftest.py.
"""

from __future__ import annotations

import re
import threading
import time

from multislice.backends.gke import GkeBackend
from multislice.steps import admit

RUN_ID = "run-1111"
POOLS = ["tpu-pool-0", "tpu-pool-1"]

#: How long a controller script waits for the step to observe a change, seconds: far beyond what a loaded
#: machine needs, below the step's own deadlines in FAST (so a scenario gone wrong names the missing event).
WAIT_SECONDS = 60.0


class Told:
    """The progress lines the steps tell (``[<step> <stage>] message``), for controller scripts to wait on.

    A script makes a change, then :meth:`wait_for` the line that proves the step
    observed it, before its next change. Lines are consumed in order: a wait
    looks only at lines told after the one the previous wait matched (and after
    the script's :class:`Background` started).
    """

    def __init__(self):
        self.lines: list[str] = []
        self._cursor = 0
        self._open = True
        self._changed = threading.Condition()

    def add(self, message: str) -> None:
        with self._changed:
            self.lines.append(message)
            self._changed.notify_all()

    def start(self) -> None:
        """A script starts: later waits look at lines told from now on."""
        with self._changed:
            self._cursor, self._open = len(self.lines), True

    def close(self) -> None:
        """The step under test returned: waits for lines it has not told fail at once."""
        with self._changed:
            self._open = False
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = WAIT_SECONDS) -> str:
        """The first line told after the last match that ``re.search``-es ``pattern``; waits up to ``timeout`` s.

        Raises:
            AssertionError: not told within ``timeout`` seconds, or the step returned without telling it.
        """
        wanted = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for index in range(self._cursor, len(self.lines)):
                    if wanted.search(self.lines[index]):
                        self._cursor = index + 1
                        return self.lines[index]
                self._cursor = len(self.lines)
                left = deadline - time.monotonic()
                if not self._open or left <= 0:
                    why = "the step returned" if not self._open else f"{timeout:.0f} s passed"
                    raise AssertionError(f"{why} before it told a line matching {pattern!r}; it told: {self.lines}")
                self._changed.wait(left)


class Background:
    """Runs a controller script in a thread while the step runs; re-raises its failure in the test.

    Use as ``with Background(script, told): step(...)``: on leaving, ``told`` is
    closed (the script's waits for the step end), the script is joined and its
    failure raised; when the step failed too, the script's failure is a note on it.
    """

    def __init__(self, script, told: Told | None = None):
        self.error = None
        self.told = told
        if told is not None:
            told.start()
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script):
        try:
            script()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self.error = error

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if self.told is not None:
            self.told.close()
        if error is None:
            self.join()
            return False
        self.thread.join(WAIT_SECONDS)
        if self.error is not None:
            error.add_note(f"the controller script failed too: {self.error!r}")
        return False

    def join(self):
        self.thread.join(WAIT_SECONDS)
        if self.thread.is_alive():
            raise AssertionError(f"the controller script still runs after {WAIT_SECONDS:.0f} s")
        if self.error:
            raise self.error


def stage_of(plan):
    """The plan's first stage, the one every scenario runs."""
    return plan.stages[0]


def admitted(play, plan, kube):
    """``admit`` of the plan's first stage on ``kube`` while the scripted Kueue queues and then admits its JobSet."""
    js = stage_of(plan).jobset

    def kueue():
        play.kueue_queues(js, "waiting")
        play.kueue_admits(js)

    with Background(kueue):
        return admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
