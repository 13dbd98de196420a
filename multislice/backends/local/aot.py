"""Preflight's AOT compiles on this machine: one trainer-environment process answers a stream of requests.

The process runs :mod:`multislice.trainer.aot` (MaxText's own
``train_compile`` path with libtpu's topology description; no TPU is needed),
so MaxText and JAX are imported once however many configs the planner tries.
Requests go in on its stdin as JSON lines; results come back as JSON lines in
a results file.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from multislice import cancel, libtpu_flags
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.cancel import die_with_parent
from multislice.preflight import AOT_MODULE, CompileTimeout, PreflightError, unknown_flag_fix


class AotSession:
    """A trainer-environment process that AOT-compiles requests one at a time.

    Use as a context manager. :meth:`compile` sends one request and waits for
    its result (a dict, see :mod:`multislice.trainer.aot`); the process starts
    with the first request and ends when the context does.

    Args:
        cache_dir: Verdict cache (path or ``gs://``), or None for no cache.
        work_dir: Where the process's results file and MaxText scratch go.
        env_dir: The trainer environment (default :func:`trainer_env`).

    Raises:
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """

    def __init__(self, cache_dir: str | None, work_dir: str | Path, env_dir: Path | None = None):
        self.env_dir = env_dir or trainer_env()
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.results = self.work_dir / "aot-results.jsonl"
        self.log = self.work_dir / "aot.log"
        self.cache_dir = cache_dir
        self.process: subprocess.Popen | None = None
        self._read = 0
        self._flags: dict[str, str] = {}  # the running process's libtpu flags

    def __enter__(self) -> AotSession:
        return self  # the trainer process starts with the first compile: a search that prunes everything starts none

    def _start(self, flags: dict[str, str]) -> subprocess.Popen:
        self.results.unlink(missing_ok=True)
        self._read = 0
        command = [str(self.env_dir / "bin" / "python"), "-m", AOT_MODULE, "--results", str(self.results)]
        command += ["--scratch", str(self.work_dir / "scratch")]
        if self.cache_dir:
            command += ["--cache-dir", self.cache_dir]
        env = trainer_process_env(self.env_dir)
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
        # libtpu reads its flags once per process: the process runs with the request's (the TPU pods' value).
        env[libtpu_flags.ENV] = libtpu_flags.init_args(flags)
        self._flags = dict(flags)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, text=True,
                preexec_fn=die_with_parent(),  # a SIGKILLed step's compile process goes with it
            )  # fmt: skip
        return self.process

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the trainer process now; the caller has every verdict it asked for.

        The process is killed rather than left to exit: each answered request's result is already in the
        results file and, for a verdict, in the verdict cache (:func:`multislice.trainer.aot.answer` writes
        the cache before the result), so nothing is lost; waiting for its interpreter to shut down (JAX and
        libtpu teardown) held the user 18-22 s after the verdict under load (issue 28). A request still
        compiling (a cancelled step) is abandoned.
        """
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            if self.process.stdin:
                self.process.stdin.close()
        self.process = None

    def compile(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait for its result.

        A request whose ``libtpu_flags`` differ from the running process's gets a new process (libtpu
        reads ``LIBTPU_INIT_ARGS`` once, when it initialises).

        Raises:
            CompileTimeout: no result within ``timeout`` seconds; the process was stopped, and
                the next call starts a new one.
            PreflightError: the trainer process died (an unknown libtpu flag ends it: the fix says so).
        """
        flags = dict(request.get("libtpu_flags") or {})
        if self.process is not None and flags != self._flags:
            self.close()
        process = self.process
        if process is None:
            process = self._start(flags)
            cancel.point("preflight:compiling")
        assert process.stdin is not None  # started with stdin=PIPE
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.results.read_text(encoding="utf-8").splitlines() if self.results.exists() else []
            if len(lines) > self._read:
                self._read += 1
                return json.loads(lines[self._read - 1])
            if process.poll() is not None:
                tail = _tail(self.log)
                raise PreflightError(
                    f"the AOT compile process exited with status {process.returncode} before answering "
                    f"{request.get('name')!r}; its log ({self.log}) ends:\n{tail}",
                    unknown_flag_fix(tail),
                )
            time.sleep(0.2)
        self.close()
        raise CompileTimeout(f"no AOT verdict for {request.get('name')!r} within {timeout:.0f} s; log: {self.log}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""
