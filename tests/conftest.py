"""Shared fixtures.

The suite runs in the pipeline environment. What needs the trainer environment
(JAX, MaxText, Orbax) runs there as a subprocess, as it does in production.
``local_run`` runs the whole pipeline once per session (what ``make run``
does) and is shared by the end-to-end assertions and the verifier tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gcs import HNS_PROBE_OFF, FakeGcs
from tests.inotify import wait_for_glob

os.environ.update(HNS_PROBE_OFF)  # before anything imports gcsfs (see tests/gcs.py)
# No test reaches the real Cloud Storage: without the ``gcs`` fixture, gs:// goes to a closed loopback port.
os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"

from multislice import config, storage  # noqa: E402
from multislice.backends.local import trainer_env, trainer_process_env  # noqa: E402
from multislice.backends.local.jobsets import LocalJobSets, pid_alive  # noqa: E402
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
class Intrusion:
    """A second ``multislice run`` of the shared run's name into its output directory, started while it trained.

    Attributes:
        returncode, stdout, stderr: The second run's.
        owner_running: The shared run was still running when the second one ended.
        owner_before, owner_after: ``owner.json`` of the run directory before and after the second run.
        before, after: The run directory's entries (top level) before and after it.
    """

    returncode: int
    stdout: str
    stderr: str
    owner_running: bool
    owner_before: str
    owner_after: str
    before: list[str]
    after: list[str]


@dataclass
class Killed:
    """A worker SIGKILLed while the twin's stage 1 trained (after its first periodic checkpoint was committed).

    Attributes:
        jobset: The stage's JobSet.
        pod: The killed pod's name (``<jobset>-slice-<j>-<i>``).
        after_step: The periodic checkpoint that was committed when the pod was killed.
        landed: The pod was alive when it was killed (False: the stage had ended first).
    """

    jobset: str
    pod: str
    after_step: int
    landed: bool


@dataclass
class LocalRun:
    """One finished ``multislice run --profile local``."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    plan: Plan
    intrusion: Intrusion | None = None
    killed: Killed | None = None


#: The run beside the shared end-to-end run, in the same output directory (so the same preflight cache):
#: the local-synthetic profile (the same slices and recipes on MaxText's synthetic data, the small 1024-token
#: model), whose stage 1 the verifier tests break copies of (its functional checks replay the logged loss on
#: the synthetic batch, which a real-data stage has no equivalent of); stage 2 trains 6 steps.
TWIN_PROFILE = "local-synthetic"
#: The twin trains on one slice (issue 13: a single-slice run end to end); stage 2's FSDP over DCN
#: across 2 slices becomes 1, and preflight compiles both stages for 1 x v5litepod-8. A worker of its
#: stage 1 is SIGKILLed after the first periodic checkpoint (:func:`_kill_a_worker`): the JobSet restarts
#: and the stage resumes from that checkpoint (what a lost host does to a run).
TWIN_SETTINGS = {
    "run_name": "e2e-twin", "stage1_steps": 20, "stage2_steps": 6, "num_slices": 1,
    "stages.tiny-70b-recipe.dcn.fsdp": 1,
}  # fmt: skip


def _start_run(settings: dict[str, object], output: Path, profile: str = "local") -> subprocess.Popen:
    """Start ``multislice run``, its output to files beside the output directory (a full pipe would stall it)."""
    sets = [arg for key, value in {**settings, "output_dir": output}.items() for arg in ("--set", f"{key}={value}")]
    logs = output.parent / f"{settings['run_name']}.cli"
    with open(f"{logs}.stdout", "w") as stdout, open(f"{logs}.stderr", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "multislice.cli", "run", "--profile", profile, *sets],
            stdout=stdout, stderr=stderr, text=True, cwd=ROOT,
        )  # fmt: skip


def _finish_run(
    proc: subprocess.Popen, settings: dict[str, object], output: Path, started: float, profile: str = "local"
) -> LocalRun:
    try:
        proc.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    logs = output.parent / f"{settings['run_name']}.cli"
    stdout, stderr = (Path(f"{logs}.{name}").read_text() for name in ("stdout", "stderr"))
    spec = config.load_profile(profile, {**settings, "output_dir": str(output)})
    return LocalRun(proc.returncode, stdout, stderr, time.monotonic() - started, make_plan(spec))


def _intrude(owner: subprocess.Popen, settings: dict[str, object], output: Path) -> Intrusion:
    """Once the running ``owner`` has its first JobSet (it trains), run ``multislice run`` with its run_name and
    output directory to the end (it is refused at once), noting what the run directory held before and after."""
    run_dir = output / str(settings["run_name"])
    pidfd = os.pidfd_open(owner.pid)
    try:  # the owner's first JobSet's state file appearing (inotify), or the owner ending
        wait_for_glob(output, f"{run_dir.name}/jobsets/*/state.json", 3600, pidfd)
    finally:
        os.close(pidfd)
    read = lambda: (run_dir / "owner.json").read_text() if (run_dir / "owner.json").exists() else ""  # noqa: E731
    owner_before, before = read(), sorted(p.name for p in run_dir.iterdir())
    sets = ["--set", f"run_name={settings['run_name']}", "--set", f"output_dir={output}"]
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local", *sets],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    after = sorted(p.name for p in run_dir.iterdir())
    return Intrusion(done.returncode, done.stdout, done.stderr, owner.poll() is None, owner_before, read(), before,
                     after)  # fmt: skip


def _kill_a_worker(owner: subprocess.Popen, settings: dict[str, object], output: Path) -> Killed | None:
    """Once ``owner``'s stage 1 has committed its first periodic checkpoint (inotify on its commit file),
    SIGKILL host 1 of slice 0 of that stage's JobSet: the JobSet restarts and the stage resumes from it."""
    spec = config.load_profile(TWIN_PROFILE, {**settings, "output_dir": str(output)})
    plan = make_plan(spec)
    stage = plan.stages[0]
    step = stage.checkpoint_period
    commit = Path(stage.checkpoint_dir, str(step), storage.COMMIT_FILE).relative_to(output)
    pidfd = os.pidfd_open(owner.pid)
    try:
        if not wait_for_glob(output, str(commit), 3600, pidfd):
            return None
    finally:
        os.close(pidfd)
    victim = LocalJobSets(plan.run_dir).get_jobset(stage.jobset).pod(0, 1)
    landed = pid_alive(victim.pid)
    if landed:
        os.kill(victim.pid, signal.SIGKILL)
    return Killed(stage.jobset, victim.hostname, step, landed)


@pytest.fixture(scope="session")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalRun, LocalRun]:
    """Two ``multislice run --profile local`` at once, as ``make run`` does, in one output directory.

    The first (run name ``e2e``, 20 steps a stage) is what most end-to-end
    tests read; the second (:data:`TWIN_SETTINGS`) runs beside it from start to
    end, so any number of local runs sharing a machine is tested by every CI
    run without a run of its own. While the first trains, a third run of its
    name into its output directory is started (its :attr:`LocalRun.intrusion`):
    it must be refused before writing anything, and the first still train and verify.
    """
    output = tmp_path_factory.mktemp("e2e-output")
    settings = {"run_name": "e2e"}
    started = time.monotonic()
    main, twin = _start_run(settings, output), _start_run(TWIN_SETTINGS, output, TWIN_PROFILE)
    killed: list[Killed] = []
    killer = threading.Thread(target=lambda: killed.append(_kill_a_worker(twin, TWIN_SETTINGS, output)))
    killer.start()
    intrusion = _intrude(main, settings, output)
    first = _finish_run(main, settings, output, started)
    first.intrusion = intrusion
    second = _finish_run(twin, TWIN_SETTINGS, output, started, TWIN_PROFILE)
    killer.join()
    second.killed = killed[0] if killed else None
    return first, second


@pytest.fixture(scope="session")
def local_run(local_runs: tuple[LocalRun, LocalRun]) -> LocalRun:
    """The shared end-to-end run (``e2e``): the whole pipeline through the CLI, as ``make run`` does."""
    return local_runs[0]


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch):
    """Cloud Storage on 127.0.0.1 with bucket ``bucket`` (:class:`tests.gcs.FakeGcs`), for this process."""
    with FakeGcs() as fake:
        for key, value in fake.env.items():
            monkeypatch.setenv(key, value)
        yield fake


# The modules whose set-up is a real MaxText run (a shared run fixture, or a run of their own): `make test`'s two
# pytest-xdist workers take them as one unit of work, in this order, on one worker, first, while the other worker
# takes the rest of the suite module by module (so module fixtures run once). Each real run already keeps both
# cores busy with its JAX processes: two at once (measured: load 33 on 2 cores) only slow both.
REAL_RUN_MODULES = (
    "tests/e2e/test_local_run.py", "tests/e2e/test_artifacts.py", "tests/e2e/test_lineage.py",
    "tests/test_notebook.py", "tests/trainer/test_verify.py", "tests/e2e/test_elastic.py", "tests/e2e/test_ray.py",
)  # fmt: skip
#: The session fixtures that run a real pipeline: a module using one must be in REAL_RUN_MODULES.
REAL_RUN_FIXTURES = ("local_runs", "elastic_run")
REAL_RUNS = "real-runs"


def _unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return REAL_RUNS if module in REAL_RUN_MODULES else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real runs first, in :data:`REAL_RUN_MODULES`' order (the workers take units in collection order).

    Raises:
        pytest.UsageError: a module uses a real run's fixture but is not in :data:`REAL_RUN_MODULES` (its run
            would be repeated on the other worker).
    """
    stray = sorted({item.nodeid.split("::")[0] for item in items if _unit(item.nodeid) != REAL_RUNS
                    and any(f in getattr(item, "fixturenames", ()) for f in REAL_RUN_FIXTURES)})  # fmt: skip
    if stray:
        raise pytest.UsageError(f"add {stray} to REAL_RUN_MODULES in tests/conftest.py: they use a real run")
    last = len(REAL_RUN_MODULES)
    rank = {module: i for i, module in enumerate(REAL_RUN_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], last))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Units of work for pytest-xdist: :data:`REAL_RUNS` and each other module (xdist's ``loadgroup`` marks do
    not reach pytest 9's node ids, so the units are made here)."""
    from xdist.scheduler import LoadScopeScheduling  # pytest-xdist: only when the suite runs on workers

    class RealRunsThenModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return RealRunsThenModules(config, log)
