"""The Ray launcher's driver: Ray Train's ``JaxTrainer`` runs MaxText's train in every Ray worker.

Usage (the RayJob's entrypoint, submitted through Ray's Jobs API: by KubeRay's submitter on GKE, by
:mod:`multislice.trainer.ray_job` in the local backend's driver pod)::

    python -m multislice.trainer.ray_driver --slices=S --hosts-per-slice=H --chips-per-host=C \\
        --max-failures=M --storage-path=DIR --name=NAME [--min-slices=m] \\
        [--tpu --topology=4x4 --accelerator-type=TPU-V6E | --distributed-timeout=T] -- key=value ...

One Ray worker per host: ``S x H`` workers (elastic ``(m x H, S x H)`` with
``--min-slices``), ``FailureConfig(max_failures=M)`` (the run's ``max_restarts``),
``RunConfig(storage_path=DIR)``: the stage's checkpoint directory, where MaxText
writes its Orbax checkpoints too (Ray Train keeps its own run state under
``DIR/<NAME>``, a directory name Orbax's step listing ignores).

On TPU (``--tpu``) Ray Train's JAX backend initialises ``jax.distributed`` and sets
``MEGASCALE_*`` itself (ray 2.60.0 ``ray/train/v2/jax/config.py``), and MaxText runs
as in a JobSet pod. The driver connects to the cluster it was submitted to (``RAY_ADDRESS``, set by the Jobs
API) and never starts a Ray instance itself. On CPU (the local backend's head on this machine) Ray Train does
not initialise ``jax.distributed`` (``_JaxBackend.on_start`` returns early without
``use_tpu``/``use_gpu``), so each worker does it, as the JobSet path's worker does:
from its world rank it sets MaxText's multi-process CPU variables
(``JOB_INDEX`` = rank // H, ``JOB_COMPLETION_INDEX`` = rank % H,
``PROCESSES_IN_JOB`` = H, ``JAX_PROCESS_COUNT``), rank 0 picks the coordinator's
address and a free port and broadcasts it (``ray.train.collective``), every
worker calls :func:`multislice.trainer.worker.initialize_cpu_distributed`, and
MaxText runs under :func:`multislice.trainer.emulated_slices.install`, so the
processes of each emulated slice form one DCN granule (FSDP over DCN works as
with JobSets).

Progress: the leader's (rank 0's) stdout and stderr, and one line per worker
naming its rank, slice, host and pid, come to the driver through a Ray queue and
are printed unprefixed, so the train step reads the driver's output as it reads
a JobSet leader's log. A worker failure is retried by Ray Train (a new worker
group; MaxText resumes from the last checkpoint), up to ``M`` times.

Test hook (local only): ``--kill-rank=R --kill-after-step=N`` (or
``MULTISLICE_RAY_KILL_WORKER=NAME:R:N`` in the environment) makes the driver
SIGKILL the worker of rank R when the leader first reports step N or later, to
exercise ``FailureConfig`` through an event of the run rather than a timer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import threading
from typing import Any, cast

from multislice import maxtext
from multislice.trainer import compile_cache, digests, elastic_data, lean_imports, worker

#: Test hook from the environment (the local backend passes its environment to pods): ``NAME:RANK:STEP``
#: applies ``--kill-rank=RANK --kill-after-step=STEP`` to the driver whose ``--name`` is NAME.
KILL_HOOK_ENV = "MULTISLICE_RAY_KILL_WORKER"
#: Line prefix of the per-worker line (the driver's kill hook reads it).
WORKER_LINE = re.compile(r"multislice ray worker: rank (?P<rank>\d+) of (?P<world>\d+).* pid (?P<pid>\d+)")
_STEP = re.compile(r"completed step: (?P<step>\d+)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split the driver's options from the MaxText ``key=value`` arguments after ``--``."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, maxtext_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.ray_driver", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--slices", type=int, required=True)
    parser.add_argument("--hosts-per-slice", type=int, required=True)
    parser.add_argument("--chips-per-host", type=int, required=True)
    parser.add_argument("--min-slices", type=int, default=None, help="elastic: fewest slices (default: fixed)")
    parser.add_argument("--max-failures", type=int, default=0, help="FailureConfig.max_failures")
    parser.add_argument("--storage-path", required=True, help="RunConfig.storage_path: the checkpoint directory")
    parser.add_argument("--name", required=True, help="RunConfig.name")
    parser.add_argument("--tpu", action="store_true", help="TPU workers (ScalingConfig(use_tpu=True))")
    parser.add_argument("--topology", default=None)
    parser.add_argument("--accelerator-type", default=None)
    parser.add_argument("--distributed-timeout", type=float, default=300.0, help="CPU: jax.distributed timeouts, s")
    parser.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill-after-step", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(own)
    hook = os.environ.get(KILL_HOOK_ENV, "")
    if hook and options.kill_rank is None and hook.split(":")[0] == options.name:
        _, rank, step = hook.split(":")
        options.kill_rank, options.kill_after_step = int(rank), int(step)
    if options.min_slices is not None and not 0 < options.min_slices <= options.slices:
        parser.error(f"--min-slices must be between 1 and --slices ({options.slices}), got {options.min_slices}")
    bad = [a for a in maxtext_args if "=" not in a]
    if bad:
        parser.error(f"MaxText arguments must be key=value, got {bad}")
    return options, maxtext_args


def worker_counts(options: argparse.Namespace) -> int | tuple[int, int]:
    """``ScalingConfig.num_workers``: one worker per host; ``(min, max)`` when elastic."""
    most = options.slices * options.hosts_per_slice
    if options.min_slices is None or options.min_slices == options.slices:
        return most
    return (options.min_slices * options.hosts_per_slice, most)


def cpu_env_for_rank(rank: int, world: int, hosts_per_slice: int) -> dict[str, str]:
    """MaxText's multi-process CPU variables for the worker of world rank ``rank`` (as a JobSet pod has them)."""
    return {
        maxtext.ENV_JOB_INDEX: str(rank // hosts_per_slice),
        maxtext.ENV_JOB_COMPLETION_INDEX: str(rank % hosts_per_slice),
        maxtext.ENV_PROCESSES_IN_JOB: str(hosts_per_slice),
        maxtext.ENV_PROCESS_COUNT: str(world),
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class _Tee:
    """Redirect this process's stdout and stderr into a pipe whose lines go to the original stdout and a queue."""

    def __init__(self, queue: Any):
        self.queue = queue
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()

    def _pump(self, read: int) -> None:
        with os.fdopen(read, "rb") as pipe:
            for raw in pipe:
                os.write(self.saved[0], raw)
                try:
                    self.queue.put(raw.decode("utf-8", errors="replace").rstrip("\n"))
                except Exception:  # noqa: BLE001 - the driver is gone; keep the worker's own log
                    pass

    def close(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)  # closes the pipe's last write end: the pump sees EOF
        self.thread.join(timeout=10)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What every Ray worker runs: set up JAX for its rank, then MaxText's train with the stage's arguments."""
    import ray.train
    from ray.train import collective

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    hosts = config["hosts_per_slice"]
    queue = config["queue"]
    queue.put(
        f"multislice ray worker: rank {rank} of {world} (slice {rank // hosts}, host {rank % hosts}) pid {os.getpid()}"
    )
    tee = _Tee(queue) if rank == 0 else None
    try:
        if not config["tpu"]:
            os.environ.update(cpu_env_for_rank(rank, world, hosts))
            address = None
            if rank == 0:
                import ray.util

                address = (ray.util.get_node_ip_address(), _free_port())
            # every rank gets rank 0's address (ray types the result as the argument, None on the others)
            host, port = cast(tuple[str, int], collective.broadcast_from_rank_zero(address))
            os.environ[maxtext.ENV_COORDINATOR_ADDRESS] = host
            os.environ[maxtext.ENV_COORDINATOR_PORT] = str(port)
            worker.initialize_cpu_distributed(max(1, round(config["distributed_timeout"])))
            print(f"multislice worker: jax.distributed initialised (coordinator {host}:{port})", flush=True)
        _run_maxtext(config["maxtext_args"], emulate_slices=None if config["tpu"] else hosts, leader=rank == 0)
    finally:
        if tee is not None:
            tee.close()


def _run_maxtext(maxtext_args: list[str], emulate_slices: int | None, leader: bool = False) -> None:
    """MaxText's train in this Ray worker; the leader (rank 0) records checkpoint digests as a JobSet's does.

    It starts as a JobSet's worker does (:func:`multislice.trainer.worker.main`): only what the step loop uses is
    imported (:mod:`multislice.trainer.lean_imports`: no torch or transformers), and it says which heavy packages
    were imported.
    """
    lean_imports.install(maxtext_args)  # before MaxText is imported: no torch, transformers... for the step loop
    import yaml
    from absl import app
    from maxtext.trainers.pre_train import train

    print(
        f"multislice ray worker: MaxText imported; heavy packages imported: "
        f"{', '.join(lean_imports.loaded()) or 'none'} (of {', '.join(lean_imports.HEAVY)})",
        flush=True,
    )

    base_yml, argv = worker.maxtext_argv(maxtext_args)  # the tokenizer's maxtext: path resolved, as on a JobSet
    elastic_data.install(maxtext_args)  # an elastic stage's grain iterator restores on any process count
    compile_cache.report_compiles()
    if emulate_slices:  # CPU: each process writes its own cache entries, as a JobSet's workers do
        compile_cache.write_from_every_process()

    def run() -> None:
        # absl's app.run parses absl flags (MaxText reads them) and exits: a clean exit is success here.
        try:
            app.run(train.main, argv=argv)
        except SystemExit as done:
            if done.code not in (None, 0):
                raise RuntimeError(f"MaxText's train exited with status {done.code}") from None

    with digests.recording(maxtext_args, leader=leader):
        if emulate_slices:
            from multislice.trainer import emulated_slices  # jax at import: only when emulating slices

            axis_names = yaml.safe_load(base_yml.read_text())["mesh_axes"]
            with emulated_slices.install(emulate_slices, axis_names):
                run()
        else:
            run()


class _Relay:
    """Drains the workers' queue into the driver's stdout; the kill hook acts on the leader's step lines."""

    def __init__(self, queue: Any, kill_rank: int | None, kill_after_step: int | None):
        self.queue = queue
        self.kill_rank, self.kill_after_step = kill_rank, kill_after_step
        self.pids: dict[int, int] = {}
        self.killed = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ray.util.queue import Empty

        while not (self.stop.is_set() and self.queue.empty()):
            try:
                line = self.queue.get(block=True, timeout=1)
            except Empty:
                continue
            print(line, flush=True)
            self._on_line(line)

    def _on_line(self, line: str) -> None:
        if found := WORKER_LINE.search(line):
            self.pids[int(found["rank"])] = int(found["pid"])
        found = _STEP.search(line)
        if (
            found
            and not self.killed
            and self.kill_after_step is not None
            and int(found["step"]) >= self.kill_after_step
            and self.kill_rank in self.pids
        ):
            self.killed = True
            pid = self.pids[self.kill_rank]
            print(
                f"multislice ray driver: killing the worker of rank {self.kill_rank} (pid {pid}) (test hook)",
                flush=True,
            )
            os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def submission_id() -> str | None:
    """This driver's Jobs API submission id; None when it was not submitted through the Jobs API.

    The job's supervisor passes it in the job config's metadata (``RAY_JOB_CONFIG_JSON_ENV_VAR``, key
    ``job_submission_id``: ray 2.60.0 ``job_supervisor.py``, ``JobSupervisor.__init__`` and
    ``_get_driver_env_vars``).
    """
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    except ValueError:
        return None
    return (config.get("metadata") or {}).get("job_submission_id")


def build_trainer(options: argparse.Namespace, maxtext_args: list[str], queue: Any) -> Any:
    """The stage's ``JaxTrainer`` (not started)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    if options.tpu:
        scaling = ScalingConfig(
            use_tpu=True,
            num_workers=worker_counts(options),
            topology=options.topology,
            accelerator_type=options.accelerator_type,
            resources_per_worker={"TPU": options.chips_per_host},
        )
    else:
        scaling = ScalingConfig(use_tpu=False, num_workers=worker_counts(options), resources_per_worker={"CPU": 1})
    return JaxTrainer(
        train_loop_per_worker,
        train_loop_config={
            "maxtext_args": maxtext_args,
            "hosts_per_slice": options.hosts_per_slice,
            "tpu": options.tpu,
            "distributed_timeout": options.distributed_timeout,
            "queue": queue,
        },
        scaling_config=scaling,
        run_config=RunConfig(
            name=options.name,
            storage_path=options.storage_path,
            failure_config=FailureConfig(max_failures=options.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the stage's JaxTrainer to its end; 0 when it succeeded, 1 when it failed after its retries."""
    options, maxtext_args = parse_args(sys.argv[1:] if argv is None else argv)
    import ray
    from ray.util.queue import Queue

    # The running cluster this driver was submitted to: KubeRay's RayJob on GKE, the local backend's head
    # (multislice.trainer.ray_job) here. Its Jobs API supervisor sets RAY_ADDRESS to the cluster's GCS address
    # (ray 2.60.0 job_supervisor.py, _get_driver_env_vars); without it, "auto" finds a cluster of this machine
    # or fails: the driver never starts a Ray instance of its own.
    address = os.environ.get("RAY_ADDRESS") or "auto"
    runtime_env = None
    if not options.tpu:
        # The local backend: one CPU device per emulated chip in every worker, and the workers' timeouts.
        runtime_env = {
            "env_vars": {
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={options.chips_per_host}",
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                # Ray Train gives a worker group 60 s to start (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S); four
                # processes importing Ray and JAX on two loaded cores take longer. Same bound as collectives.
                "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{options.distributed_timeout:g}",
            }
        }
    ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
    print(
        f"multislice ray driver: connected to the Ray cluster at {address} (Jobs API submission {submission_id()})",
        flush=True,
    )
    print(
        f"multislice ray driver: JaxTrainer with {worker_counts(options)} workers ({options.slices} slices x "
        f"{options.hosts_per_slice} hosts, {'TPU' if options.tpu else 'CPU'}), max_failures {options.max_failures}, "
        f"storage {options.storage_path}",
        flush=True,
    )
    queue = Queue()
    relay = _Relay(queue, options.kill_rank, options.kill_after_step)
    try:
        result = build_trainer(options, maxtext_args, queue).fit()
    except Exception as error:  # noqa: BLE001 - Ray Train's TrainingFailedError and its causes
        relay.close()
        print(f"multislice ray driver: training failed: {type(error).__name__}: {error}", flush=True)
        return 1
    relay.close()
    error = getattr(result, "error", None)
    if error is not None:
        print(f"multislice ray driver: training failed: {error}", flush=True)
        return 1
    print("multislice ray driver: training succeeded", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
