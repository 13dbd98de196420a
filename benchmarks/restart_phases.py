"""Benchmark: two phases of a restart that this machine can measure for the restart-cost model (docs/goodput.md).

Run from the project root in the pipeline environment (the trainer environment must exist), on a quiet machine::

    .venvs/pipeline/bin/python -m benchmarks.restart_phases [--gib 2] [--repeats 3]

- ``jax_distributed``: two fresh trainer-environment processes (the coordinator, process 0, and process 1) start
  at once, import JAX and call ``jax.distributed.initialize`` on CPU with a new coordinator port, as a restarted
  attempt's processes do; reported: the seconds inside ``initialize`` in each process (the connect and the
  barrier, not the imports), and the imports before it.
- ``orbax_restore``: Orbax's ``StandardCheckpointer`` (orbax-checkpoint, the library MaxText checkpoints with)
  saves a train-state-shaped pytree of ``--gib`` GiB of float32 (16 arrays) to a RAM disk (``/dev/shm``, tmpfs:
  what GKE's multi-tier checkpointing driver's node-local tier is) and restores it, ``--repeats`` times; reported:
  restore seconds and bytes per second, pinned to one core and then to all of this machine's (the restore is
  CPU-bound: the per-core rate is what the restart-cost model scales). The read is from memory into this
  process's host memory; on a TPU host the restore also copies host to HBM (PCIe), which this machine has no
  device for.

Writes ``benchmarks/results/restart_phases.json`` with the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.preflight import machine

ROOT = Path(__file__).resolve().parents[1]
TRAINER_PY = ROOT / ".venvs" / "trainer" / "bin" / "python"

_DISTRIBUTED = """
import json, sys, time
t0 = time.monotonic()
import jax
t1 = time.monotonic()
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=120)
t2 = time.monotonic()
print(json.dumps({"process": int(sys.argv[2]), "import_seconds": round(t1 - t0, 3),
                  "initialize_seconds": round(t2 - t1, 3), "devices": jax.device_count()}))
jax.distributed.shutdown()
"""

_RESTORE = """
import json, os, sys, time
os.sched_setaffinity(0, [int(c) for c in sys.argv[4].split(",")])
import numpy as np
import orbax.checkpoint as ocp
gib, repeats, where = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
n = 16
per = int(gib * 2**30 / 4 / n)
state = {f"layer_{i}": np.random.default_rng(i).standard_normal(per, dtype=np.float32) for i in range(n)}
nbytes = sum(a.nbytes for a in state.values())
ckpt = ocp.StandardCheckpointer()
runs = []
for r in range(repeats):
    path = f"{where}/step_{r}"
    t0 = time.monotonic()
    ckpt.save(path, state)
    ckpt.wait_until_finished()
    t1 = time.monotonic()
    restored = ckpt.restore(path, {k: np.zeros_like(v) for k, v in state.items()})
    t2 = time.monotonic()
    assert all(np.array_equal(restored[k], state[k]) for k in state)
    runs.append({"save_seconds": round(t1 - t0, 3), "restore_seconds": round(t2 - t1, 3),
                 "restore_bytes_per_second": round(nbytes / (t2 - t1))})
    del restored
print(json.dumps({"bytes": nbytes, "runs": runs}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jax_distributed(repeats: int) -> list[dict]:
    """``repeats`` pairs of processes initialising ``jax.distributed`` on a new port each (seconds per process)."""
    runs = []
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for _ in range(repeats):
        address = f"127.0.0.1:{_free_port()}"
        procs = [
            subprocess.Popen([str(TRAINER_PY), "-c", _DISTRIBUTED, address, str(i)], stdout=subprocess.PIPE, env=env)
            for i in (0, 1)
        ]
        outs = [json.loads(p.communicate(timeout=300)[0].decode().strip().splitlines()[-1]) for p in procs]
        runs.append({"processes": outs})
    return runs


def orbax_restore(gib: float, repeats: int, cpus: list[int]) -> dict:
    """Orbax save and restore of ``gib`` GiB of float32 on tmpfs (/dev/shm), ``repeats`` times, the process pinned
    to ``cpus``."""
    where = Path(tempfile.mkdtemp(prefix="restart-phases-", dir="/dev/shm"))
    try:
        out = subprocess.run(
            [str(TRAINER_PY), "-c", _RESTORE, str(gib), str(repeats), str(where), ",".join(map(str, cpus))],
            check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return {"cpus": cpus, **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the restored state, GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "restart_phases.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    result = {
        "machine": machine(),
        "load_before": load_before,
        "jax_distributed": jax_distributed(args.repeats),
        "orbax_restore_tmpfs": [
            orbax_restore(args.gib, args.repeats, cpus) for cpus in ([0], sorted(os.sched_getaffinity(0)))
        ],
        "load_after": os.getloadavg(),
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
