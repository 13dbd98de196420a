"""A stage's checkpoint verifier started while the stage trains, its imports done by the time the verify step runs.

On this machine a verify step used to start its trainer-environment process only once training had ended, and
that process then spent seconds importing JAX, Orbax, Flax and MaxText's model code (and transformers, for a
stage that exports) before it read the checkpoint: about 8 s of stage 1's 10.5 s and 15 s of stage 2's 37 s in
``make run`` (benchmarks/README.md). So the train step asks the backend to prepare the stage's verifier
(:meth:`multislice.backends.base.Backend.prepare_verifier`), and the local backend starts it here:
``python -m multislice.trainer.warm ... MODULE ARG ...`` (:mod:`multislice.trainer.warm`) with the verifier's
module (:mod:`multislice.trainer.verify`, or :mod:`multislice.trainer.verify_export` for a stage that exports)
and the stage's arguments. It does the imports while the stage trains, then waits on a FIFO.

The verify step (:func:`run`) takes it when it was started for this stage, pipeline run and command (its
module and MaxText arguments; the rest of the arguments, such as the model card's final losses, is sent with
the go request), and it is alive: it writes the request, waits for the process's end (its pidfd: it is not this
process's child) and reads its output and exit status from the files the tool wrote, as
:func:`.tools.run_tool` gives them for a process of its own. Otherwise the verifier starts as a new process, as
before.

Each tool belongs to one pipeline run: its record, ``warm/<stage>.<pipeline run id>.json`` in the run
directory, names it, and only that run's verify step, cancel and cleanup (:func:`stop_run`) touch it. An unused
tool ends by itself :data:`multislice.trainer.warm.GRACE_SECONDS` after its starter (the local backend passes
the stage JobSet's supervisor, which ends with the training) ended (pipeline failed or cancelled in between).

What a cluster does differently: the GKE backend starts the verifier's Job only in the verify step
(:meth:`multislice.backends.base.Backend.prepare_verifier` does nothing there), so its pod's image pull and
imports follow the training.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from multislice import cancel
from multislice.backends.base import VerifierTimeout
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.backends.local.jobsets import pid_alive
from multislice.trainer import warm

#: The run directory's folder of warm tools' records, FIFOs, logs and outputs.
FOLDER = "warm"
#: The train step's environment variable that turns starting verifiers ahead off (``off``); e.g. the kill soak,
#: which measures the training's goodput alone.
ENV_WARM = "MULTISLICE_LOCAL_WARM_VERIFIER"


def enabled(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether verifiers are started ahead (:data:`ENV_WARM` is not ``off``, ``0`` or ``false``)."""
    return environ.get(ENV_WARM, "on").strip().lower() not in ("off", "0", "false")


#: The module of the process started ahead.
MODULE = warm.__name__


@dataclass
class WarmTool:
    """A verifier started ahead for one stage of one pipeline run.

    Attributes:
        pid: Its process (a session of its own).
        stage: The stage it verifies.
        pipeline_run_id: The pipeline run it belongs to.
        module: The verifier's module (``python -m MODULE``).
        maxtext_args: The stage's MaxText arguments it was warmed up for.
        fifo: The FIFO it waits on for the go request.
        out: Its standard output once it runs.
        log: Its standard error (and its warm-up's output).
        status: Where it writes its exit status.
    """

    pid: int
    stage: str
    pipeline_run_id: str
    module: str
    maxtext_args: list[str]
    fifo: str
    out: str
    log: str
    status: str


def _split(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """``(module, the tool's own arguments, MaxText arguments)`` of ``[python, -m, module, ..., --, ...]``."""
    args = argv[3:]
    if "--" in args:
        cut = args.index("--")
        return argv[2], args[:cut], args[cut + 1 :]
    return argv[2], args, []


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def record_path(run_dir: str, stage: str, pipeline_run_id: str) -> Path:
    """The record of a stage's warm tool for a pipeline run."""
    return Path(run_dir, FOLDER, f"{_safe(stage)}.{_safe(pipeline_run_id)}.json")


def _alive(found: WarmTool) -> bool:
    """Whether ``found``'s process runs (:func:`.jobsets.pid_alive`) and is that tool (its command names its FIFO:
    a pid the kernel gave to another process since is not it)."""
    try:
        with open(f"/proc/{found.pid}/cmdline", "rb") as handle:
            named = found.fifo.encode() in handle.read().split(b"\0")
    except OSError:
        return False
    return named and pid_alive(found.pid)


def _load(record: Path) -> WarmTool | None:
    """The tool a record names, or None (no record, or not one)."""
    try:
        return WarmTool(**json.loads(record.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def start(
    run_dir: str,
    stage: str,
    pipeline_run_id: str,
    argv: list[str],
    starter: int | None = None,
    grace: float = warm.GRACE_SECONDS,
) -> WarmTool:
    """Start the verifier ``argv`` (``[python, -m, module, ARG ...]``) ahead for ``stage`` of ``pipeline_run_id``;
    a tool this run started earlier for the stage is stopped first. ``starter``: the process whose end starts the
    unused tool's ``grace`` seconds (default this one).

    Raises:
        OSError: the FIFO or the process could not be made.
    """
    record = record_path(run_dir, stage, pipeline_run_id)
    stop(record)
    record.parent.mkdir(parents=True, exist_ok=True)
    stem = record.with_suffix("")
    paths = {kind: f"{stem}.{kind}" for kind in ("fifo", "out", "log", "status")}
    for path in paths.values():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    os.mkfifo(paths["fifo"], 0o600)
    module, _, maxtext_args = _split(argv)
    command = [
        argv[0], "-m", MODULE, "--fifo", paths["fifo"], "--out", paths["out"], "--status", paths["status"],
        "--starter", str(os.getpid() if starter is None else starter), "--grace", str(grace), module, *argv[3:],
    ]  # fmt: skip
    with open(paths["log"], "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=trainer_process_env(trainer_env()),
            start_new_session=True,  # it outlives the train step that starts it: the verify step takes it
        )
    found = WarmTool(process.pid, stage, pipeline_run_id, module, list(maxtext_args), **paths)
    temporary = record.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(found)))
    temporary.replace(record)
    return found


def take(run_dir: str, stage: str, pipeline_run_id: str, argv: list[str]) -> WarmTool | None:
    """The warm tool this pipeline run started for ``stage``, when it is alive and was started for ``argv``'s module
    and MaxText arguments; else None (a dead or mismatched one is stopped)."""
    record = record_path(run_dir, stage, pipeline_run_id)
    found = _load(record)
    if found is None:
        return None
    module, _, maxtext_args = _split(argv)
    if found.module == module and found.maxtext_args == maxtext_args and _alive(found):
        return found
    stop(record)
    return None


def run(found: WarmTool, argv: list[str], timeout: float, cancel_point: str, what: str) -> subprocess.CompletedProcess:
    """Send ``found`` its go request with ``argv``'s arguments and wait for its end; its exit status and output,
    as :func:`.tools.run_tool` gives a process of its own. A tool that ends without a status (killed) gives 137.

    Raises:
        VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.cancel.Cancelled: the step was cancelled (it was stopped).
    """
    record = record_path_of(found)
    try:
        pidfd = os.pidfd_open(found.pid)
    except ProcessLookupError:
        pidfd = None
    try:
        if pidfd is not None:
            fifo = os.open(found.fifo, os.O_WRONLY | os.O_NONBLOCK)  # it holds the FIFO open for reading
            try:
                os.write(fifo, (json.dumps({"argv": argv[3:]}) + "\n").encode())
            finally:
                os.close(fifo)
            cancel.point(cancel_point)
            ready, _, _ = select.select([pidfd], [], [], timeout)
            if not ready:  # stopped below, as on a cancel
                raise VerifierTimeout(
                    f"{what} ran past {timeout:.0f} s and was stopped",
                    "raise timeouts.verify if the checkpoint is that large",
                )
    except BaseException:
        _kill(found.pid)
        record.unlink(missing_ok=True)
        raise
    finally:
        if pidfd is not None:
            os.close(pidfd)
    status = _read(found.status).strip()
    for used in (record, Path(found.fifo), Path(found.status)):  # its log and output stay, as a pod's log does
        used.unlink(missing_ok=True)
    code = int(status) if status.isdigit() else 137
    return subprocess.CompletedProcess(argv, code, _read(found.out), _read(found.log))


def record_path_of(found: WarmTool) -> Path:
    """The record file of ``found`` (beside its FIFO)."""
    return Path(found.fifo).with_suffix(".json")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def stop(record: Path) -> None:
    """Stop the warm tool of ``record`` (SIGKILL to its session's group: it holds nothing) and drop the record."""
    found = _load(record)
    if found is None:
        return
    if _alive(found):
        _kill(found.pid)
    record.unlink(missing_ok=True)


def stop_run(run_dir: str, pipeline_run_id: str) -> list[str]:
    """Stop every warm tool of ``pipeline_run_id`` in the run directory (never another run's); returns their
    stages."""
    stopped = []
    for record in sorted(Path(run_dir, FOLDER).glob(f"*.{_safe(pipeline_run_id)}.json")):
        found = _load(record)
        if found is not None and found.pipeline_run_id == pipeline_run_id:
            stop(record)
            stopped.append(found.stage)
    return stopped
