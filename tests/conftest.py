"""Shared fixtures.

The suite runs in the pipeline environment. What needs the trainer environment
(JAX, MaxText, Orbax) runs there as a subprocess, as it does in production.
``local_run`` runs the whole pipeline once per session (what ``make run``
does) and is shared by the end-to-end assertions and the verifier tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gcs import HNS_PROBE_OFF, FakeGcs

os.environ.update(HNS_PROBE_OFF)  # before anything imports gcsfs (see tests/gcs.py)
# No test reaches the real Cloud Storage: without the ``gcs`` fixture, gs:// goes to a closed loopback port.
os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"

from multislice import config  # noqa: E402
from multislice.backends.local import trainer_env, trainer_process_env  # noqa: E402
from multislice.plan import Plan, make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_CRDS = ROOT.parent / "shared" / "crds"


@pytest.fixture(scope="session")
def trainer_python() -> Path:
    """The trainer environment's interpreter (make env installs it)."""
    return trainer_env() / "bin" / "python"


def run_in_trainer(trainer_python: Path, script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a Python script in the trainer environment on CPU; returns the completed process."""
    env = trainer_process_env(trainer_python.parent.parent)
    return subprocess.run(
        [str(trainer_python), "-c", script, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@dataclass
class LocalRun:
    """One finished ``multislice run --profile local``."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    plan: Plan


@pytest.fixture(scope="session")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> LocalRun:
    """Run the local profile end to end through the CLI, as ``make run`` does (a few minutes)."""
    output = tmp_path_factory.mktemp("e2e-output")
    run_name = "e2e"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local",
         "--set", f"run_name={run_name}", "--set", f"output_dir={output}"],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    spec = config.load_profile("local", {"run_name": run_name, "output_dir": str(output)})
    return LocalRun(done.returncode, done.stdout, done.stderr, time.monotonic() - started, make_plan(spec))


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch):
    """Cloud Storage on 127.0.0.1 with bucket ``bucket`` (:class:`tests.gcs.FakeGcs`), for this process."""
    with FakeGcs() as fake:
        for key, value in fake.env.items():
            monkeypatch.setenv(key, value)
        yield fake
