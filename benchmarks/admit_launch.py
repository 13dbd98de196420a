"""Benchmark: the admit and launch steps' wall time on the local backend (issue 28, the pipeline's own overhead).

Run from the project root in the pipeline environment (the trainer environment must exist)::

    .venvs/pipeline/bin/python benchmarks/admit_launch.py [--repeats 5] [--compare OTHER_CHECKOUT]

Each sample is a fresh process that drives the two steps as the pipeline's components do
(:func:`multislice.steps.admit.run`, then :func:`multislice.steps.launch.run` with admit's report) on the local
profile's first stage, with a :class:`~multislice.backends.local.LocalBackend`: admit renders and validates the
JobSet, creates it (its supervisor starts) and waits for admission; launch waits for every pod to run. The pods'
container is replaced by a sleeping Python process, so what is timed is the steps' and the supervisor's own
overhead, not MaxText's start-up; the JobSet is deleted after each sample. With ``--compare DIR`` the code of the
checkout ``DIR`` (e.g. the main branch's) is timed too, its samples alternating with this checkout's, so both see
the same load. Reports the median of each, with ``uptime``'s load average before and after; writes
``benchmarks/results/admit_launch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "admit_launch.json"
SLEEPER = "import time; time.sleep(600)"


def once(output_dir: str) -> dict:
    """One sample in this process: seconds of admit and of launch (the code on ``sys.path``)."""
    from multislice import config  # noqa: PLC0415 - imported from the checkout the sample times (PYTHONPATH)
    from multislice.backends.local import LocalBackend  # noqa: PLC0415 - as above
    from multislice.plan import make_plan  # noqa: PLC0415 - as above
    from multislice.steps import admit, launch  # noqa: PLC0415 - as above

    plan = make_plan(config.load_profile("local", {"run_name": "bench", "output_dir": output_dir}))
    stage = plan.stages[0]
    backend = LocalBackend(plan.run_dir)
    rendered = backend.workload_manifest

    def sleeping_pods(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the backend's own signature
        manifest = rendered(*args, **kwargs)
        for job in manifest["spec"]["replicatedJobs"]:
            job["template"]["spec"]["template"]["spec"]["containers"][0].update(
                command=["python", "-c", SLEEPER], args=[]
            )
        return manifest

    backend.workload_manifest = sleeping_pods  # type: ignore[method-assign]
    started = time.monotonic()
    admitted = admit.run(plan, stage, "bench-run", backend=backend)
    after_admit = time.monotonic()
    launch.run(plan, stage, admitted, backend=backend)
    ended = time.monotonic()
    backend.delete(stage.workload)
    return {"admit_seconds": after_admit - started, "launch_seconds": ended - after_admit,
            "total_seconds": ended - started}  # fmt: skip


def sample(code: Path) -> dict:
    """One sample of the code in checkout ``code``, in a fresh interpreter (imports counted as a step's are not:
    the timing starts once the steps' modules are imported)."""
    with tempfile.TemporaryDirectory(prefix="admit-launch-") as output_dir:
        env = {**os.environ, "PYTHONPATH": str(code)}
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--once", output_dir],
            env=env, cwd=code, capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"sample of {code} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def uptime() -> str:
    """``uptime``'s line (the load averages over 1, 5 and 15 minutes)."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    """Time ``--repeats`` samples (of this checkout, and alternately of ``--compare``'s); print and write them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout whose code is timed alternately")
    parser.add_argument("--once", metavar="OUTPUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.once:
        print(json.dumps(once(args.once)))
        return 0
    codes = {"this checkout": ROOT} | ({"compared": args.compare.resolve()} if args.compare else {})
    load_before = uptime()
    samples: dict[str, list[dict]] = {label: [] for label in codes}
    for _ in range(args.repeats):
        for label, code in codes.items():
            samples[label].append(sample(code))
    load_after = uptime()
    result = {"load_before": load_before, "load_after": load_after, "repeats": args.repeats, "codes": {}}
    for label, code in codes.items():
        medians = {key: round(statistics.median(s[key] for s in samples[label]), 2) for key in samples[label][0]}
        rounded = [{k: round(v, 2) for k, v in s.items()} for s in samples[label]]
        result["codes"][label] = {"path": str(code), "median": medians, "samples": rounded}
        print(f"{label} ({code}): median of {args.repeats}: admit {medians['admit_seconds']} s, "
              f"launch {medians['launch_seconds']} s, admit + launch {medians['total_seconds']} s")  # fmt: skip
    print(f"load before: {load_before}\nload after:  {load_after}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
