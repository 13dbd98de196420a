"""The run's persistent compilation cache serves a restarted attempt: real JAX compiles in the trainer environment.

A stage's pods compile (attempt 0), then start again as a restart starts them (attempt 1): new processes, a new
coordinator address and port, the next in-place restart attempt, each pod with its process id and hostname. Every
process loads its program from the cache (``multislice/trainer/compile_cache.py``: JAX's cache key hashes the
program, compile options, XLA flags and the devices' topology, nothing of the coordinator or the attempt).
The pods are the local profile's stage-1 pods as rendered (:func:`expand_jobset`: 2 slices x 2 hosts, 4 CPU devices
each); each runs :mod:`tests.trainer.compile_cache_pod` (the worker's distributed join and cache set-up, then one
compile of a program sharded over all 16 devices) instead of MaxText, whose first compile here takes minutes.
"""

import os
import subprocess

from multislice import config, metrics
from multislice.backends.local import trainer_process_env
from multislice.backends.local.environment import free_port
from multislice.backends.local.pods import expand_jobset
from multislice.backends.local.state import IN_PLACE_RESTART_ATTEMPT_KEY
from multislice.plan import make_plan
from multislice.render import jobset
from tests.conftest import ROOT

#: Layers of the compiled program: about 2 s of XLA compile on this 2-core machine, above JAX's 1 s threshold for
#: writing a cache entry (``jax_persistent_cache_min_compile_time_secs``, default 1.0, which MaxText keeps).
OPS = 50


def start_attempt(trainer_python, pods, cache_dir, address, attempt, logs):
    """Start every pod's process of one attempt, at ``address`` and a free port; their logs under ``logs``."""
    port = str(free_port())
    procs = []
    for pod in pods:
        env = {**trainer_process_env(trainer_python.parent.parent), **pod.env, "HOSTNAME": pod.hostname}
        env.update(JAX_COORDINATOR_ADDRESS=address, JAX_COORDINATOR_PORT=port, PYTHONPATH=str(ROOT))
        log = logs / f"{pod.hostname}.attempt-{attempt}.log"
        with open(log, "wb") as out:
            argv = [str(trainer_python), "-m", "tests.trainer.compile_cache_pod", str(cache_dir), str(OPS)]
            procs.append((pod, log, subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)))
    return procs


def compiles(procs, timeout=600):
    """Each pod's compile lines once its process ended (it exited 0)."""
    found = {}
    for pod, log, proc in procs:
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-3000:]
        lines = log.read_text().splitlines()
        found[pod.hostname] = [c for c in map(metrics.parse_compile_line, lines) if c]
    return found


def test_a_restarted_stage_loads_its_programs_from_the_cache(tmp_path, trainer_python):
    spec = config.load_profile("local", {"run_name": "cache", "output_dir": str(tmp_path)})
    plan = make_plan(spec)
    manifest = jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id="run-a")
    first = expand_jobset(manifest)
    again = expand_jobset(manifest, restart_attempt=1, annotated={p.hostname: {IN_PLACE_RESTART_ATTEMPT_KEY: "1"}
                                                                   for p in first})  # fmt: skip
    assert [p.hostname for p in again] == [p.hostname for p in first] and len(first) == 4
    cache_dir = tmp_path / "jax_cache"  # the plan's jax_cache_dir, here on local disk
    logs = tmp_path / "pods"
    logs.mkdir()

    compiled = compiles(start_attempt(trainer_python, first, cache_dir, "127.0.0.1", 0, logs))
    for hostname, lines in compiled.items():
        assert [(c["function"], c["cache_hit"]) for c in lines] == [("jit(program)", False)], hostname
    assert len(os.listdir(cache_dir)) >= len(first)  # one entry per process (its own key on CPU) at least

    # The restart: new processes, another coordinator address (127.0.0.2 is this machine too) and port
    restarted = compiles(start_attempt(trainer_python, again, cache_dir, "127.0.0.2", 1, logs))
    for hostname, lines in restarted.items():
        assert [(c["function"], c["cache_hit"]) for c in lines] == [("jit(program)", True)], hostname
        (hit,) = lines
        (miss,) = compiled[hostname]
        assert hit["seconds"] < miss["seconds"], (hostname, hit, miss)
