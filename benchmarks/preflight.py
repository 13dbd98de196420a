"""Benchmark: how long preflight takes to give its verdicts, and the planner to find a fitting 70B config.

Run from the project root in the pipeline environment (the trainer environment must exist)::

    .venvs/pipeline/bin/python -m benchmarks.preflight [--skip-planner] [--record tests/data/aot_recorded.json]

Measures, each with an empty verdict cache:

1. the seed 70B command (example stage ``seed-llama3-70b`` of ``gke-v6e-16x2-seed``):
   seconds until preflight says "does not fit" (trainer process start included);
2. the two default stages of ``gke-v6e-16x2-seed`` (8B and 70B): seconds until each verdict;
3. the same two stages again with the cache now filled: seconds for both verdicts;
4. the planner for llama3-70b on 2 x v6e-16: seconds until it returns AOT-verified configs.

Writes ``benchmarks/results/preflight.json`` with the machine (cores, load
average at start and end, memory) and prints a Markdown table for the README.
With ``--record``, every AOT result is added to the recorded set the memory
model's tests check against.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from multislice import config, timings
from multislice.backends.local.aot import AotSession
from multislice.plan import make_plan
from multislice.preflight import planner, request_for, stage_report

#: One compile's time limit: the local backend's.
COMPILE_TIMEOUT = timings.DEFAULTS["local"].compile_timeout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "preflight.json"


def machine() -> dict:
    """Cores, memory and load of this machine."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        total = int(handle.readline().split()[1]) * 1024
    return {
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(total / 2**30, 1),
        "processor": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }


def timed_verdicts(plan, stages, cache: str, work: Path) -> list[dict]:
    """One session: each stage's verdict and the seconds from session start until it arrived."""
    started = time.monotonic()
    out = []
    with AotSession(cache, work) as session:
        for stage in stages:
            report = stage_report(plan, stage, session.compile(request_for(plan, stage), timeout=COMPILE_TIMEOUT))
            out.append({"stage": stage.name, "seconds": round(time.monotonic() - started, 1), "report": report})
    return out


def record(path: Path, cache_dirs: list[Path]) -> int:
    """Add the AOT results stored in ``cache_dirs`` to the recorded set at ``path``; returns how many were new.

    The recorded set (``tests/data/aot_recorded.json``) is what the memory model's tests check
    against: for each compile, the target, the MaxText arguments, the verdict and the bytes per chip.
    """
    data = json.loads(path.read_text()) if path.exists() else {"results": []}
    data["source"] = "AOT compiles on this machine (benchmarks/preflight.py --record); versions per result"
    seen = {_record_key(r) for r in data["results"]}
    added = 0
    for cache in cache_dirs:
        for file in sorted(cache.glob("*.json")):
            result = json.loads(file.read_text())
            if result.get("verdict") not in ("fits", "does_not_fit") or "maxtext_args" not in result:
                continue
            entry = {
                "compile_topology": result["compile_topology"],
                "num_slices": result["num_slices"],
                "maxtext_args": result["maxtext_args"],
                "verdict": result["verdict"],
                "total_bytes": result.get("memory", {}).get("total"),
                "required_bytes": result.get("oom", {}).get("required_bytes"),
                "versions": result.get("versions"),
            }
            if result.get("libtpu_init_args"):
                entry["libtpu_init_args"] = result["libtpu_init_args"]
            key = _record_key(entry)
            if key not in seen:
                data["results"].append(entry)
                seen.add(key)
                added += 1
    path.write_text(json.dumps(data, indent=1) + "\n")
    return added


def _record_key(entry: dict) -> str:
    """What makes two recorded compiles the same: target, MaxText arguments (less scratch paths), libtpu flags."""
    args = sorted(a for a in entry["maxtext_args"] if not a.startswith(("base_output_directory=", "run_name=")))
    return json.dumps([entry["compile_topology"], entry["num_slices"], args, entry.get("libtpu_init_args", "")])


def main() -> None:
    """Run the measurements; write the results file and print the README table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-planner", action="store_true")
    parser.add_argument("--only-planner", action="store_true", help="measure the planner alone (item 4)")
    parser.add_argument("--record", type=Path, help="add every AOT result to this recorded set")
    parser.add_argument("--collect", type=Path, nargs="*", help="only add the results in these cache dirs to --record")
    options = parser.parse_args()
    if options.collect is not None:
        print(f"{record(options.record, options.collect)} results added to {options.record}")
        return
    start_machine = machine()
    spec = config.load_profile("gke-v6e-16x2-seed")
    results: dict = json.loads(RESULTS.read_text()) if options.only_planner and RESULTS.exists() else {}
    if not options.only_planner:
        results["machine"] = start_machine
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        caches = [tmp_path / name for name in ("cache-seed", "cache", "cache-planner")]
        if not options.only_planner:
            _defaults(results, spec, caches, tmp_path)
            results["machine_at_end"] = machine()
        if options.only_planner or not options.skip_planner:
            started = time.monotonic()
            with AotSession(str(caches[2]), tmp_path / "w4") as session:
                found = planner.search(spec, spec.stage("llama3-70b"), session, compile_timeout=COMPILE_TIMEOUT)
            results["planner_70b_2x_v6e16"] = {
                "seconds": round(time.monotonic() - started, 1),
                "fitting": [c.describe() for c in found.fitting],
                "tried": [(c.describe(), c.verdict) for c in found.tried],
                "machine": start_machine,
                "machine_at_end": machine(),
            }
        if options.record:
            record(options.record, caches)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


def _defaults(results: dict, spec, caches: list[Path], tmp_path: Path) -> None:
    """Items 1-3: the seed 70B's verdict, the default stages cold, then from the cache."""
    seed_plan = make_plan(config.load_spec(config.spec_to_data(spec.with_stages(spec.stage("seed-llama3-70b")))))
    seed = timed_verdicts(seed_plan, seed_plan.stages, str(caches[0]), tmp_path / "w1")
    results["seed_70b_does_not_fit"] = {"seconds": seed[0]["seconds"], "verdict": seed[0]["report"].verdict}
    default_plan = make_plan(spec)
    cold = timed_verdicts(default_plan, default_plan.stages, str(caches[1]), tmp_path / "w2")
    previous = 0.0
    results["default_stages_cold"] = []
    for item in cold:
        results["default_stages_cold"].append(
            {"stage": item["stage"], "seconds": round(item["seconds"] - previous, 1), **_numbers(item["report"])}
        )
        previous = item["seconds"]
    warm = timed_verdicts(default_plan, default_plan.stages, str(caches[1]), tmp_path / "w3")
    results["default_stages_cached_seconds"] = warm[-1]["seconds"]


def _numbers(report) -> dict:
    total = report.used_bytes_per_chip
    return {"verdict": report.verdict, "gib_per_chip": round(total / 2**30, 2) if total else None}


if __name__ == "__main__":
    main()
