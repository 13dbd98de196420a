"""Entry point of every training pod: runs MaxText 0.2.5's pre-training loop.

Usage (the container command of the JobSet)::

    python -m multislice.trainer.worker [--emulate-slices] -- key=value ...

The ``key=value`` arguments go to ``maxtext.trainers.pre_train.train`` after
MaxText's ``base.yml``. With ``--emulate-slices`` (CPU pods) the processes of
each JobSet child Job form one DCN granule (see
:mod:`multislice.trainer.emulated_slices`). MaxText's per-step lines
(``completed step: N, ... loss: L``) in the leader's log are what the train
step reads, on every backend.

The process index comes from the environment MaxText's CPU path reads
(``JOB_INDEX * PROCESSES_IN_JOB + JOB_COMPLETION_INDEX``); on TPU it is 0
here, and MaxText finds the real one itself.

On CPU (``--emulate-slices``) the worker initialises ``jax.distributed``
itself before MaxText starts, at ``JAX_COORDINATOR_ADDRESS`` and the port in
``JAX_COORDINATOR_PORT`` (MaxText's own CPU path always uses port 1234,
``maxtext/utils/max_utils.py``, ``initialize_jax_for_cpu``, and skips its
initialisation when JAX's is done: ``maybe_initialize_jax_distributed_system``).
So the local backend can give each JobSet a free port and any number of local
runs share one machine.

Every process uses the run's persistent compilation cache (``jax_cache_dir``);
on CPU each writes its own entries (:mod:`multislice.trainer.compile_cache`),
and each prints a line per compile saying whether it came from the cache.

The leader (process 0: slice 0, host 0) records the digests of each
checkpoint step once Orbax commits it (:mod:`multislice.trainer.digests`),
in a thread beside training and once more when training ends.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from multislice.maxtext import (
    CPU_COORDINATOR_PORT,
    ENV_COORDINATOR_ADDRESS,
    ENV_COORDINATOR_PORT,
    ENV_JOB_COMPLETION_INDEX,
    ENV_JOB_INDEX,
    ENV_PROCESS_COUNT,
    ENV_PROCESSES_IN_JOB,
    TRAIN_MODULE,
)
from multislice.trainer import compile_cache, digests, elastic_data, lean_imports, tiered_checkpoint


def process_index_from_env(env: dict[str, str] | os._Environ = os.environ) -> int:
    """JAX process index as MaxText computes it on CPU, or 0 when the variables are absent."""
    try:
        slice_index, hosts = int(env[ENV_JOB_INDEX]), int(env[ENV_PROCESSES_IN_JOB])
        return slice_index * hosts + int(env[ENV_JOB_COMPLETION_INDEX])
    except KeyError:
        return 0


def coordinator_address(env: dict[str, str] | os._Environ = os.environ) -> str:
    """``host:port`` of the JAX coordinator (process 0) for CPU pods.

    Raises:
        KeyError: ``JAX_COORDINATOR_ADDRESS`` is not set.
        ValueError: ``JAX_COORDINATOR_PORT`` is not a port number (1-65535).
    """
    port = int(env.get(ENV_COORDINATOR_PORT) or CPU_COORDINATOR_PORT)
    if not 0 < port < 65536:
        raise ValueError(f"{ENV_COORDINATOR_PORT}={port} is not a TCP port")
    return f"{env[ENV_COORDINATOR_ADDRESS]}:{port}"


def initialize_cpu_distributed(timeout_seconds: int, env: dict[str, str] | os._Environ = os.environ) -> None:
    """Initialise ``jax.distributed`` for this CPU process as MaxText's CPU path would, at our port.

    Same process id and count as ``initialize_jax_for_cpu``; ``timeout_seconds``
    bounds joining, missed heartbeats and shutdown. A single process (no
    ``JAX_PROCESS_COUNT`` above 1) initialises nothing.
    """
    count = int(env.get(ENV_PROCESS_COUNT) or 1)
    if count <= 1:
        return
    import jax

    jax.distributed.initialize(
        coordinator_address=coordinator_address(env),
        num_processes=count,
        process_id=process_index_from_env(env),
        initialization_timeout=timeout_seconds,
        heartbeat_timeout_seconds=timeout_seconds,
        shutdown_timeout_seconds=timeout_seconds,
    )


def seconds_since_process_start() -> float:
    """Seconds since this process started (Linux ``/proc/self/stat`` field 22, in clock ticks since boot)."""
    with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
        started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


def resolve_package_paths(maxtext_args: list[str]) -> list[str]:
    """The arguments with ``key=maxtext:<path>`` made ``key=<path inside the installed maxtext package>``, and
    ``key=multislice:<path>`` a path inside this package (the Hugging Face-format Llama 3 tokenizer).

    The plan names the tokenizers maxtext ships so (``tokenizer_path=maxtext:assets/tokenizers/...``),
    as the package's place differs between the trainer image, a venv and a source checkout.
    """
    from multislice.config.data import MAXTEXT_PREFIX, PACKAGE_PREFIX, resolve_path  # pydantic (~1.5 s): only here

    resolved = []
    for argument in maxtext_args:
        key, _, value = argument.partition("=")
        if value.startswith(MAXTEXT_PREFIX):
            import maxtext

            value = str(Path(maxtext.__file__).parent / value.removeprefix(MAXTEXT_PREFIX))
        elif value.startswith(PACKAGE_PREFIX):
            value = resolve_path(value)
        resolved.append(f"{key}={value}")
    return resolved


def maxtext_argv(maxtext_args: list[str]) -> tuple[Path, list[str]]:
    """MaxText's base config (``maxtext/configs/base.yml``) and the ``argv`` its ``train.main`` takes.

    ``argv`` is ``[train module, base.yml, *maxtext_args]`` with the ``maxtext:`` paths resolved
    (:func:`resolve_package_paths`); the JobSet worker and the Ray driver's workers both build it here.
    """
    from maxtext import configs

    base_yml = Path(configs.__file__).with_name("base.yml")
    return base_yml, [TRAIN_MODULE, str(base_yml), *resolve_package_paths(maxtext_args)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split the worker's own options from the MaxText ``key=value`` arguments after ``--``."""
    if "--" in argv:
        split = argv.index("--")
        own, maxtext_args = argv[:split], argv[split + 1 :]
    else:
        own, maxtext_args = [], argv
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.worker", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--emulate-slices", action="store_true", help="group each child Job's processes into a slice")
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=300.0,
        help="CPU: jax.distributed timeouts (joining, heartbeats, shutdown), seconds",
    )
    options = parser.parse_args(own)
    bad = [a for a in maxtext_args if "=" not in a]
    if bad:
        parser.error(f"MaxText arguments must be key=value, got {bad}")
    return options, maxtext_args


def main(argv: list[str] | None = None) -> None:
    """Run MaxText training with this pod's arguments; exits with MaxText's status."""
    options, maxtext_args = parse_args(sys.argv[1:] if argv is None else argv)
    process_index = process_index_from_env()
    print(
        f"multislice worker: process {process_index} (slice {os.environ.get(ENV_JOB_INDEX, '?')}, "
        f"host {os.environ.get(ENV_JOB_COMPLETION_INDEX, '?')}) of {os.environ.get(ENV_PROCESS_COUNT, '?')}",
        flush=True,
    )

    if options.emulate_slices:  # before anything of MaxText's can start a JAX backend
        import jax  # noqa: F401 (timed apart from jax.distributed's join below)

        joining = seconds_since_process_start()  # Python's start and ``import jax``
        initialize_cpu_distributed(max(1, round(options.distributed_timeout)))
        joined = seconds_since_process_start()
        print(
            f"multislice worker: jax.distributed initialised (coordinator {coordinator_address()}) "
            f"{joined:.1f} s after the process started, {joined - joining:.1f} s of it joining",
            flush=True,
        )

    lean_imports.install(maxtext_args)  # no torch, transformers... for the step loop
    compile_cache.report_compiles()
    if options.emulate_slices:  # CPU: each process has its own cache key (multislice.trainer.compile_cache)
        compile_cache.write_from_every_process()
    import yaml
    from absl import app
    from maxtext.trainers.pre_train import train

    print(
        f"multislice worker: MaxText imported {seconds_since_process_start():.1f} s after the process started; "
        f"heavy packages imported: {', '.join(lean_imports.loaded()) or 'none'} (of {', '.join(lean_imports.HEAVY)})",
        flush=True,
    )
    elastic_data.install(maxtext_args)  # an elastic stage's grain iterator restores on any process count
    tiered_checkpoint.install(maxtext_args)  # multi-tier checkpoints keep the stage's persistent ones
    base_yml, argv_for_maxtext = maxtext_argv(maxtext_args)
    # The leader records each committed checkpoint step's digests (the verifier checks them).
    with digests.recording(maxtext_args, leader=process_index == 0):
        if options.emulate_slices:
            from multislice.trainer import emulated_slices  # jax at import: only when emulating slices

            axis_names = yaml.safe_load(base_yml.read_text())["mesh_axes"]
            with emulated_slices.install(int(os.environ[ENV_PROCESSES_IN_JOB]), axis_names):
                app.run(train.main, argv=argv_for_maxtext)
        else:
            app.run(train.main, argv=argv_for_maxtext)


if __name__ == "__main__":
    main()
