"""prepare_data's shard workers as processes of this machine's trainer environment.

Worker ``i`` is ``python -m multislice.trainer.prepare_shards worker --request ... --index i``
(:func:`multislice.trainer.prepare_shards.worker_command`), the command the GKE backend's Indexed Job runs with
the index from ``$JOB_COMPLETION_INDEX``; at most ``parallelism`` run at once, the next starting when one ends.
Each one's output lines are passed on as they come; its peak resident memory is the kernel's ``ru_maxrss`` from
``wait4`` (Linux: KiB). The first failure stops the others (SIGTERM, then they are waited for), as a failed index
fails the Indexed Job (``maxFailedIndexes: 0``).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from multislice import cancel
from multislice.backends.base import DataWorkersFailed, Tell, WorkerExit
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.cancel import die_with_parent
from multislice.trainer import prepare_shards


class _Worker:
    """One running worker process: its output read by a thread, its end reaped with ``wait4``."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str], tell: Tell, done: threading.Condition):
        self.index, self.tail, self.done = index, deque(maxlen=20), done
        self.exit: WorkerExit | None = None
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=die_with_parent()
        )
        self.thread = threading.Thread(target=self._read, args=(tell,), daemon=True)
        self.thread.start()

    def _read(self, tell: Tell) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if line.startswith(prepare_shards.SAY):
                tell(line.removeprefix(prepare_shards.SAY))
        # Reaped here, not by Popen.wait: wait4 also gives the child's peak resident memory.
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        with self.done:
            self.exit = WorkerExit(
                index=self.index, exit_code=self.process.returncode, seconds=round(time.monotonic() - self.started, 2),
                max_rss_bytes=usage.ru_maxrss * 1024,
            )  # fmt: skip
            self.done.notify_all()

    def stop(self) -> None:
        """SIGTERM it if it still runs; its reader thread reaps it."""
        if self.exit is None:
            try:
                self.process.terminate()
            except ProcessLookupError:
                pass


def run(request: dict[str, Any], parallelism: int | None, timeout: float, tell: Tell) -> list[WorkerExit]:
    """Run the request's ``workers`` shard workers, ``parallelism`` (None: all) at once; how each ended, by index.

    Raises:
        DataWorkersFailed: a worker exited non-zero (its last lines quoted; the others stopped), or they ran past
            ``timeout`` seconds (stopped).
        multislice.cancel.Cancelled: the step was cancelled (every worker stopped first).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    env_dir = trainer_env()
    env = trainer_process_env(env_dir)
    # This package, from where this process has it (a worktree or an install), first on the workers' path.
    env["PYTHONPATH"] = str(Path(prepare_shards.__file__).resolve().parents[2])
    python = str(env_dir / "bin" / "python")
    count = int(request["workers"])
    at_once = min(parallelism or count, count)
    done = threading.Condition()
    running: list[_Worker] = []
    waiting = list(range(count))
    deadline = time.monotonic() + timeout
    try:
        with done:
            while True:
                failed = next((w for w in running if w.exit is not None and w.exit.exit_code != 0), None)
                if failed is not None:
                    status = failed.exit.exit_code if failed.exit else "?"
                    raise DataWorkersFailed(
                        f"shard worker {failed.index} exited with status {status}; its last lines:\n"
                        + "\n".join(failed.tail),
                        "fix the cause above (the data spec's files, their format, the tokenizer), then rerun",
                    )
                while waiting and sum(w.exit is None for w in running) < at_once:
                    index = waiting.pop(0)
                    argv = prepare_shards.worker_command(request, python, index)
                    running.append(_Worker(index, argv, env, tell, done))
                if not waiting and all(w.exit is not None for w in running):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataWorkersFailed(
                        f"prepare_data's shard workers ran past {timeout:.0f} s and were stopped",
                        "raise timeouts.prepare_data, or data.workers to split the sources further",
                    )
                cancel.point("prepare_data:workers")
                done.wait(min(left, 1.0))  # woken by a worker's end; the second bounds a cancel's delay
    finally:
        for each in running:
            each.stop()
        for each in running:
            each.thread.join()
    return sorted((w.exit for w in running if w.exit is not None), key=lambda e: e.index)
