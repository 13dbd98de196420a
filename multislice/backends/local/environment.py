"""What the local backend needs of this machine: the trainer environment, memory, and free coordinator ports.

The local backend runs every pod, AOT compile and verifier as a process of
the trainer environment (``.venvs/trainer``, MaxText with JAX), which
``make env`` installs from ``requirements/trainer.txt``. Without a checkout
(the package installed from a wheel), ``multislice env install DIR``
(:func:`install_trainer_env`) builds one from the same lock files, which the
wheel carries (``multislice/data/*-requirements.txt``), and
``MULTISLICE_TRAINER_ENV`` names it.
"""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib import metadata
from pathlib import Path

from multislice.config import PROJECT_ROOT
from multislice.errors import InputError, RunFailed
from multislice.heartbeat import Heartbeat, heartbeat

#: Names the trainer environment (a venv directory); else :data:`DEFAULT_TRAINER_ENV`.
TRAINER_ENV_VAR = "MULTISLICE_TRAINER_ENV"
#: Where the trainer environment is, unless MULTISLICE_TRAINER_ENV says otherwise.
DEFAULT_TRAINER_ENV = PROJECT_ROOT / ".venvs" / "trainer"
#: The lock files ``make env`` installs, packaged with the library (links to ``requirements/`` in a checkout).
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TRAINER_LOCK = DATA_DIR / "trainer-requirements.txt"
LOADER_HF4_LOCK = DATA_DIR / "loader-hf4-requirements.txt"
#: This distribution's name (pyproject.toml; :data:`multislice.release.DISTRIBUTION`).
DISTRIBUTION = "multislice-pipelines"
#: The import packages of this distribution (what a wheel installs), copied into a trainer environment.
PACKAGES = ("multislice", "components", "pipelines")
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
    path = Path(os.environ.get(TRAINER_ENV_VAR, DEFAULT_TRAINER_ENV)).resolve()
    if not (path / "bin" / "python").exists():
        named = f"{TRAINER_ENV_VAR}={os.environ[TRAINER_ENV_VAR]}" if os.environ.get(TRAINER_ENV_VAR) else (
            f"{TRAINER_ENV_VAR} is not set")  # fmt: skip
        raise TrainerEnvMissing(
            f"no trainer environment (MaxText, JAX, Orbax) at {path} ({named})",
            f"build one with `multislice env install ~/multislice-envs` (about 8 GB: MaxText, JAX, torch, Ray) and "
            f"set {TRAINER_ENV_VAR}=~/multislice-envs/trainer; in a source checkout `make env` builds .venvs/trainer",
        )
    return path


def _site_packages(python: Path) -> Path:
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(done.stdout.strip())


def copy_packages(site_packages: Path) -> list[Path]:
    """Copy this distribution's import packages (:data:`PACKAGES`, as this Python imports them; links
    resolved, no ``__pycache__``) and a ``.dist-info`` naming its version into ``site_packages``.

    Returns:
        The directories written.
    """
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # the packages on PYTHONPATH without their metadata
        version = "0+unknown"
    written = []
    for name in PACKAGES:
        module_file = importlib.import_module(name).__file__
        if module_file is None:  # a namespace package has no __file__; each of PACKAGES is a regular one
            raise RuntimeError(f"package {name} has no __init__.py to locate its source by")
        source = Path(module_file).parent
        target = site_packages / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
        written.append(target)
    info = site_packages / f"multislice_pipelines-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("multislice env install\n")
    return [*written, info]


def find_uv() -> str:
    """The uv executable ``multislice env install`` runs: ``uv`` on PATH, else the one the ``uv`` package (a
    dependency of the ``pipeline`` extra; its wheel ships the binary) installed beside this Python.

    Raises:
        InputError: neither is there.
    """
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if found:
        return found
    try:
        from uv import find_uv_bin  # the uv package's own lookup (its scripts directory)

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        raise InputError(
            "no uv executable: not on PATH, not beside " + sys.executable,
            "install it with `pip install uv` (or install this package with its extra: "
            "`pip install 'multislice-pipelines[pipeline]'`, which brings it)",
        ) from None


def _count_dists(site_packages: Path) -> int:
    return sum(1 for _ in site_packages.glob("*.dist-info")) if site_packages.is_dir() else 0


def _lock_pins(lock: Path) -> int:
    return sum(
        1 for line in Path(lock).read_text().splitlines() if line.strip() and not line.lstrip().startswith(("#", "-"))
    )


def run_streamed(
    argv: list[str],
    what: str,
    tell: Callable[[str], object],
    *,
    every: float = 10.0,
    detail: Callable[[], str] | None = None,
    beats: Callable[..., AbstractContextManager[Heartbeat]] = heartbeat,
) -> None:
    """Run ``argv`` (an argument list, no shell), telling each line of its output as it comes (indented), and a
    heartbeat (``what``, elapsed time, ``detail``) after each ``every`` seconds without one.

    Raises:
        RunFailed: it exited non-zero (its exit status and the end of its output in the message).
    """
    tell("$ " + shlex.join(argv))
    tail: deque[str] = deque(maxlen=30)
    with beats(what, tell, every, detail=detail) as beat:
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                line = line.rstrip()
                tail.append(line)
                beat.tell("  " + line)
            returncode = proc.wait()
    if returncode != 0:
        output = "\n".join(tail)
        raise RunFailed(
            f"{Path(argv[0]).name} exited {returncode}: {output[-2000:]}",
            "fix what the output says, then rerun `multislice env install` (it reuses the venvs, and uv's cache "
            "keeps what was downloaded)",
        )


def install_trainer_env(
    directory: str | Path,
    *,
    python: str = sys.executable,
    trainer_lock: Path = TRAINER_LOCK,
    loader_lock: Path = LOADER_HF4_LOCK,
    tell: Callable[[str], object] = print,
    every: float = 10.0,
    beats: Callable[..., AbstractContextManager[Heartbeat]] = heartbeat,
) -> Path:
    """Build the trainer environment ``make env`` builds, for a package installed without a checkout.

    As the Makefile's ``.venvs/trainer`` and ``.venvs/loader-hf4`` targets do, with uv (:func:`find_uv`):
    ``directory/trainer``: ``uv venv`` of ``python`` (3.12), ``uv pip sync --compile-bytecode`` of the trainer
    lock file (MaxText 0.2.5, JAX, Orbax, torch, Ray: about 8 GB, as pinned), and this package copied in
    (:func:`copy_packages`; the Makefile's editable install needs a checkout); ``directory/loader-hf4``: the
    export check's transformers 4.57 loader, a venv of its three pins (``uv pip install --no-deps``) layered
    over the trainer's packages by a ``.pth`` file, where :mod:`multislice.trainer.export` looks for it (beside
    the trainer environment). Downloads go to uv's cache (``uv cache dir``), which is kept: an interrupted
    install rerun fetches only what is missing, and a machine that ran ``make env`` downloads nothing.

    Every command is an argument list, told before it runs; its output is told line by line as it comes,
    and a heartbeat line (elapsed time, the last phase uv named, packages installed so far) after each
    ``every`` seconds without one (:func:`run_streamed`).

    Args:
        directory: Where to put both venvs (created).
        python: The interpreter the venvs are made from.
        trainer_lock, loader_lock: The pinned requirements (default: the packaged lock files).
        tell: Where the lines go.
        every: Seconds of silence before a heartbeat line.
        beats: The heartbeat (:func:`multislice.heartbeat.heartbeat`; a test's stand-in).

    Returns:
        The trainer environment's directory: set ``MULTISLICE_TRAINER_ENV`` to it.

    Raises:
        InputError: a lock file is missing, ``python`` is not Python 3.12 (the lock files' version), or no uv.
        RunFailed: a command failed (its exit status and the end of its output in the message).
    """
    root = Path(directory).expanduser().resolve()
    for lock in (trainer_lock, loader_lock):
        if not Path(lock).is_file():
            raise InputError(f"no lock file {lock}", "reinstall the package (its wheel carries multislice/data/)")
    version = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                             capture_output=True, text=True)  # fmt: skip
    if version.stdout.strip() != "3.12":
        raise InputError(f"{python} is Python {version.stdout.strip() or '?'}, not 3.12",
                         "give --python /path/to/python3.12 (the lock files pin packages for 3.12)")  # fmt: skip
    uv = find_uv()
    trainer, loader = root / "trainer", root / "loader-hf4"
    site = trainer / "lib" / "python3.12" / "site-packages"
    pins = _lock_pins(trainer_lock)

    def installed() -> str:
        done = _count_dists(site)
        phase = "; uv compiles their bytecode (--compile-bytecode, as make env)" if done >= pins else ""
        return f"{done} of {pins} packages installed in {site}{phase}"

    def step(argv: list[str], what: str, detail: Callable[[], str] | None = None) -> None:
        run_streamed(argv, what, tell, every=every, detail=detail, beats=beats)

    step([uv, "venv", "--allow-existing", "--python", python, str(trainer)], f"uv venv {trainer}")
    step([uv, "pip", "sync", "--compile-bytecode", "--python", str(trainer / "bin" / "python"), str(trainer_lock)],
         f"uv pip sync of {Path(trainer_lock).name} (downloads to uv's cache, then installs)", installed)  # fmt: skip
    site = _site_packages(trainer / "bin" / "python")
    tell(f"copying {', '.join(PACKAGES)} into {site}")
    copy_packages(site)
    step([uv, "venv", "--allow-existing", "--python", python, str(loader)], f"uv venv {loader}")
    step([uv, "pip", "install", "--no-deps", "--compile-bytecode", "--python", str(loader / "bin" / "python"),
          "--requirement", str(loader_lock)], f"uv pip install of {Path(loader_lock).name}")  # fmt: skip
    layered = _site_packages(loader / "bin" / "python") / "zz-trainer.pth"
    layered.write_text(f"import site; site.addsitedir({str(site)!r})\n")
    tell(f"trainer environment ready: export {TRAINER_ENV_VAR}={trainer}")
    return trainer


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
