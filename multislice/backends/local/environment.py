"""What the local backend needs of this machine: the trainer environment, memory, and free coordinator ports.

The local backend runs every pod, AOT compile and verifier as a process of
the trainer environment (``.venvs/trainer``, MaxText with JAX), which
``make env`` installs from ``requirements/trainer.txt``.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from multislice.config import PROJECT_ROOT
from multislice.errors import InputError

#: Where the trainer environment is, unless MULTISLICE_TRAINER_ENV says otherwise.
DEFAULT_TRAINER_ENV = PROJECT_ROOT / ".venvs" / "trainer"
#: Resident memory to allow per local trainer process, bytes. Measured here: at most
#: 1.21 GiB resident per process for either stage of the local profile; doubled for headroom.
BYTES_PER_PROCESS = 2 * 1024**3


class TrainerEnvMissing(InputError):
    """The trainer environment the local processes need is not installed."""


class InsufficientCapacity(InputError):
    """This machine cannot host the run's emulated slices; the fix says what to change."""


def trainer_env() -> Path:
    """The trainer environment's directory (a venv with MaxText).

    Raises:
        TrainerEnvMissing: it has no ``bin/python``.
    """
    path = Path(os.environ.get("MULTISLICE_TRAINER_ENV", DEFAULT_TRAINER_ENV)).resolve()
    if not (path / "bin" / "python").exists():
        raise TrainerEnvMissing(
            f"no trainer environment at {path}",
            "run `make env` (it creates .venvs/trainer with MaxText), or set MULTISLICE_TRAINER_ENV to a venv "
            "with the trainer extra installed",
        )
    return path


def trainer_process_env(env: Path) -> dict[str, str]:
    """Environment for a process of the trainer environment ``env`` started from this one.

    This process's variables minus those of its own Python environment
    (``PYTHON*``, ``VIRTUAL_ENV``), with ``env/bin`` first on PATH and JAX on
    the CPU (libtpu is installed there and would otherwise look for a TPU).
    """
    child = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    child.update(JAX_PLATFORMS="cpu", PATH=f"{env / 'bin'}:{os.environ.get('PATH', '')}")
    return child


def trainer_versions(env: Path) -> dict[str, str]:
    """Versions of the packages that affect training, as installed in the trainer environment."""
    code = (
        "from importlib.metadata import version\n"
        "for p in ('maxtext', 'jax', 'jaxlib', 'orbax-checkpoint', 'libtpu'):\n"
        "    print(p, version(p))\n"
    )
    out = subprocess.run([str(env / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo, bytes."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that nothing listens on now, chosen by the kernel (bind to port 0).

    The port is released before it is returned, so another process could take
    it before the caller binds it: the kernel hands out ephemeral ports in
    turn, which makes that rare, and a coordinator that cannot bind fails its
    pod, which the JobSet's failure policy restarts with a new port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
