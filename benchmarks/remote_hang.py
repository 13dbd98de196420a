"""How long a hung remote call takes to report :class:`multislice.remote_call.RemoteHang`, on the local backend.

Run from the project root (a heavy job: 4 JAX processes)::

    heavy .venvs/pipeline/bin/python -m benchmarks.remote_hang [--timeout 30] [--runs 1]

The call is 2 emulated slices x 2 hosts (``v5litepod-8``); host 3 ignores
SIGTERM (as JAX's preemption handler catches it) and blocks forever, the others
return. Measured per run: seconds from the call to the error, and from the
progress line that starts the hang timer ("N of 4 hosts returned; waiting up
to T s") to the error, which :data:`multislice.remote_call.HANG_REPORT_SECONDS`
bounds at ``T + 15``. Prints them with the load average and appends them to
``benchmarks/results/remote_hang.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.preflight import machine

RESULTS = Path(__file__).resolve().parent / "results" / "remote_hang.jsonl"


def _block_forever_on_last_host() -> int:
    import signal
    import threading

    import jax

    if jax.process_index() == 3:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("host 3: stuck in a collective, ignoring SIGTERM", flush=True)
        threading.Event().wait()
    return jax.process_index()


def one(timeout: float) -> dict[str, float]:
    """One hung call: ``call_to_error`` and ``timer_to_error`` seconds."""
    from multislice.remote_call import RemoteHang, run_remote

    marks: dict[str, float] = {}

    def tell(line: str) -> None:
        if "hosts returned; waiting up to" in line:
            marks["timer"] = time.monotonic()

    with tempfile.TemporaryDirectory() as out:
        started = time.monotonic()
        try:
            run_remote(_block_forever_on_last_host, tpu_type="v5litepod-8", num_slices=2, output_dir=out,
                       tell=tell, collective_timeout=timeout)  # fmt: skip
        except RemoteHang:
            ended = time.monotonic()
        else:
            raise SystemExit("the call returned: no hang")
    return {"call_to_error": round(ended - started, 1), "timer_to_error": round(ended - marks["timer"], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote_hang", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=30.0, help="collective_timeout, seconds")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        before = os.getloadavg()
        times = one(args.timeout)
        row = {
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "collective_timeout": args.timeout,
            **times,
            "load_before": before,
            "load_after": os.getloadavg(),
        }
        print(json.dumps(row))
        RESULTS.parent.mkdir(exist_ok=True)
        with RESULTS.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
