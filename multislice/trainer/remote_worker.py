"""Entry point of every pod of a :func:`multislice.remote` call: run one pickled function on this host.

Usage (the container command of the remote call's JobSet)::

    python -m multislice.trainer.remote_worker --call-dir DIR [--emulate-slices --distributed-timeout S]

``DIR`` (local or ``gs://``, :mod:`multislice.storage`) holds ``payload.pkl``,
a cloudpickle of ``(function, args, kwargs)``. Each host:

1. initialises ``jax.distributed`` (CPU pods with ``--emulate-slices``: as the
   training worker does, :func:`multislice.trainer.worker.initialize_cpu_distributed`;
   TPU pods: ``jax.distributed.initialize()``, which finds the slice's hosts itself)
   and writes ``hosts/slice-S-host-H.ready``;
2. runs the function (CPU: inside :func:`multislice.trainer.emulated_slices.install`,
   so a hybrid mesh groups each child Job's processes as one slice);
3. writes ``hosts/slice-S-host-H.result``: a cloudpickle of a dict, ``ok`` and
   the value (the leader, slice 0 host 0, only), or the exception's type,
   message, formatted traceback and the exception itself when it pickles;
4. exits 0, or 1 when the function raised (the JobSet then fails at once).

Lines starting with :data:`MARK` are progress for the caller; every other line
of the leader's stdout is the function's own output. stdout and stderr are
line-buffered (:func:`line_buffered`), so each line the function prints reaches
the pod log, and the caller following it, when it is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from multislice import storage
from multislice.maxtext import ENV_JOB_COMPLETION_INDEX, ENV_JOB_INDEX, ENV_PROCESSES_IN_JOB
from multislice.trainer.worker import initialize_cpu_distributed

#: Prefix of the worker's own progress lines in a pod's log.
MARK = "[multislice.remote]"


def host_key(slice_index: int, host: int) -> str:
    """``slice-S-host-H``: the file stem of a host's markers."""
    return f"slice-{slice_index}-host-{host}"


def line_buffered() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` flush at every newline, whatever ``PYTHONUNBUFFERED`` says.

    A pod's stdout is a pipe, which Python block-buffers (8 KiB) unless told otherwise: a
    remote function's prints would reach the caller in blocks or when it returns. Streams
    without ``reconfigure`` (replaced by the caller, e.g. ``io.StringIO``) are left as they are.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _write_bytes(location: str, data: bytes) -> None:
    target = storage.path(location)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _initialise(emulate: bool, timeout: float) -> None:
    import jax

    if emulate:
        initialize_cpu_distributed(max(1, round(timeout)))
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # TPU: JAX reads the slice's hosts from the TPU environment
    jax.devices()  # the backend starts here: a host that cannot join fails now, not inside the function


def outcome_of(error: BaseException) -> dict[str, Any]:
    """A raised exception as the caller receives it: type, message, remote traceback, and itself if it pickles."""
    import cloudpickle

    try:
        pickled = cloudpickle.dumps(error)
    except Exception:  # an exception holding a lock or a socket: its text still travels
        pickled = None
    return {
        "ok": False,
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
        "exception": pickled,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the payload on this host; 0 when it returned, 1 when it raised."""
    parser = argparse.ArgumentParser(prog="python -m multislice.trainer.remote_worker")
    parser.add_argument("--call-dir", required=True, help="directory with payload.pkl; results go to hosts/")
    parser.add_argument("--emulate-slices", action="store_true", help="CPU pods: each child Job is one slice")
    parser.add_argument("--distributed-timeout", type=float, default=300.0, help="jax.distributed timeouts, s")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    line_buffered()

    import cloudpickle

    slice_index = int(os.environ.get(ENV_JOB_INDEX) or 0)
    host = int(os.environ.get(ENV_JOB_COMPLETION_INDEX) or 0)
    key = host_key(slice_index, host)
    hosts_dir = storage.join(options.call_dir, "hosts")
    print(f"{MARK} {key}: started", flush=True)
    try:
        _initialise(options.emulate_slices, options.distributed_timeout)
        import jax

        _write_bytes(storage.join(hosts_dir, f"{key}.ready"), b"")
        print(
            f"{MARK} {key}: JAX initialised, process {jax.process_index()} of {jax.process_count()}, "
            f"{jax.device_count()} devices",
            flush=True,
        )
        function, args, kwargs = cloudpickle.loads(
            storage.path(storage.join(options.call_dir, "payload.pkl")).read_bytes()
        )
        if options.emulate_slices:
            from multislice.trainer import emulated_slices  # jax at import: only when emulating slices

            with emulated_slices.install(int(os.environ.get(ENV_PROCESSES_IN_JOB) or 1)):
                value = function(*args, **kwargs)
        else:
            value = function(*args, **kwargs)
        leader = slice_index == 0 and host == 0
        outcome: dict[str, Any] = {"ok": True, "value": value if leader else None}
        try:
            data = cloudpickle.dumps(outcome)
        except Exception as error:
            raise TypeError(f"the function's return value cannot be pickled: {error}") from error
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
        outcome = outcome_of(error)
        data = cloudpickle.dumps(outcome)
    sys.stdout.flush()
    _write_bytes(storage.join(hosts_dir, f"{key}.result"), data)
    print(f"{MARK} {key}: {'returned' if outcome['ok'] else 'raised ' + outcome['type']}", flush=True)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
