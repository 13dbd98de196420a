"""A stand-in verifier for the tests of the tools started ahead (``multislice.trainer.warm``,
``multislice.backends.local.warm_tools``): run as ``python -m tests.warm_stand_in ARG ... -- KEY=VALUE ...`` in the
trainer environment from the checkout. Stdlib only.

``warm_up(args)`` stands for the verifier's imports: it says so on standard output (which the warm tool sends to
its log) and records when it ran in the environment, which the run then reads (the run is a fresh ``__main__``).
The run prints one JSON line: its arguments, whether the warm-up ran before it in this process, its pid; with an
argument ``exit=N`` it exits with status ``N``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def warm_up(args: list[str]) -> None:
    """What the verifier's warm-up stands for."""
    print(f"stand-in warm-up {args}", flush=True)
    os.environ["STAND_IN_WARMED"] = str(time.monotonic())


def main(args: list[str]) -> int:
    """The run: one JSON line, then the exit status ``exit=N`` asks for (default 0)."""
    print(json.dumps({"args": args, "warmed_first": "STAND_IN_WARMED" in os.environ, "pid": os.getpid()}))
    print("stand-in run on stderr", file=sys.stderr, flush=True)
    return next((int(a.split("=", 1)[1]) for a in args if a.startswith("exit=")), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
