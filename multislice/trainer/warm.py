"""A trainer-environment tool started ahead: it does a tool's imports while something else runs, then runs it.

The local backend starts the checkpoint verifier of a stage this way while the stage trains
(:mod:`multislice.backends.local.warm_tools`), so that the verify step, which comes after the train step in
another process, finds JAX, Orbax, Flax and MaxText's model code (and, for a stage that exports, transformers)
already imported::

    python -m multislice.trainer.warm --fifo PATH --out PATH --status PATH --starter PID [--grace S] \\
        MODULE [ARG ...]

It imports ``MODULE`` and calls its ``warm_up(args)`` where it has one (e.g.
:func:`multislice.trainer.verify.warm_up`: imports only, nothing of the checkpoint), with standard output going
where standard error goes (the tool's log), then waits on the FIFO ``--fifo`` (opened for reading and writing,
so it never sees an end of file) for one JSON line, ``{"argv": [ARG ...]}``: the tool's arguments as they are
known at the start (the model card's final losses, for instance, are known only after training). Then it points
standard output at ``--out``, runs ``MODULE`` as ``__main__`` with those arguments, as ``python -m MODULE ARG
...`` would, writes its exit status to ``--status`` (written to a temporary name, then renamed), and exits with
it.

It never waits for ever: while the process ``--starter`` (the train step that started it) runs, it waits; once
that process has ended, at most ``--grace`` seconds more (default :data:`GRACE_SECONDS`: the verify step comes
right after the train step, or never, when the pipeline failed or was cancelled). Unused, it exits 0 and runs
nothing. Both waits are events: the FIFO's readability and the starter's pidfd (``os.pidfd_open``).

Stdlib only at import.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import select
import sys
import time
import traceback

#: Seconds an unused tool waits after its starter ended (the local backend's: the stage's JobSet supervisor, which
#: ends with the training; the verify step comes seconds after).
GRACE_SECONDS = 300.0
#: The line the tool writes to its log once warmed up (then its pid and seconds).
READY = "multislice warm tool: ready"


def _parser() -> argparse.ArgumentParser:
    summary = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m multislice.trainer.warm", description=summary)
    parser.add_argument("--fifo", required=True, help="the FIFO the go request comes on")
    parser.add_argument("--out", required=True, help="standard output of the tool's run")
    parser.add_argument("--status", required=True, help="where its exit status is written")
    parser.add_argument("--starter", required=True, type=int, help="the pid of the process that started it")
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS, help="seconds to wait once the starter ended")
    parser.add_argument("module")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def wait_for_go(fifo: str, starter: int, grace: float) -> list[str] | None:
    """The arguments of the go request, or None when none came (the starter ended ``grace`` seconds ago)."""
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer of its own: never an end of file
    try:
        watched = [fd]
        try:
            pidfd: int | None = os.pidfd_open(starter)
            watched.append(pidfd)
        except ProcessLookupError:  # the starter already ended
            pidfd = None
        deadline = None if pidfd is not None else time.monotonic() + grace
        buffer = b""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select(watched, [], [], timeout)
            if not readable:
                return None
            if pidfd is not None and pidfd in readable:
                watched.remove(pidfd)
                os.close(pidfd)
                pidfd = None
                deadline = time.monotonic() + grace
            if fd in readable:
                with_data = True
                while with_data:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    with_data = bool(chunk)
                    buffer += chunk
                if b"\n" in buffer:
                    return list(json.loads(buffer.split(b"\n", 1)[0])["argv"])
    finally:
        os.close(fd)


def _write_status(path: str, status: int) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="ascii") as handle:
        handle.write(f"{status}\n")
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m multislice.trainer.warm ...`` (see the module's docstring); returns the tool's exit status."""
    options = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    stdout = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to the log, never to the tool's output
    module = importlib.import_module(options.module)
    warm_up = getattr(module, "warm_up", None)
    if warm_up is not None:
        warm_up(options.args)
    print(f"{READY}: pid {os.getpid()}, {options.module} warmed up in {time.monotonic() - started:.1f} s", flush=True)
    args = wait_for_go(options.fifo, options.starter, options.grace)
    if args is None:
        print("multislice warm tool: not used; exiting", flush=True)
        return 0
    out = os.open(options.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    os.dup2(out, 1)
    os.close(out)
    os.close(stdout)
    sys.argv = [options.module, *args]
    status = 1
    try:
        runpy.run_module(options.module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as done:
        code = done.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, int) and code is not None:
            print(code, file=sys.stderr)
    except BaseException:  # the tool failed: its traceback in the log, status 1 as Python's would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _write_status(options.status, status)
    return status


if __name__ == "__main__":
    sys.exit(main())
