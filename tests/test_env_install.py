"""``multislice env install`` with a fake uv on PATH: the argv it runs (as `make env`), its output streamed as
it comes, and a heartbeat every 10 s at most while uv is silent."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest

from multislice import cli
from multislice.backends.local import environment
from multislice.errors import RunFailed

#: A uv that logs its argv, makes real venvs (without pip) and, for `pip sync`, prints a line, waits until the
#: test has seen it (a byte the test's tell writes into the FIFO ``FAKE_UV_SEEN``, when that is set), then prints
#: the next: output kept until uv exits would leave it waiting, and it then says so and fails.
FAKE_UV = """\
    #!{python}
    import json, os, select, subprocess, sys
    from pathlib import Path
    log = Path(os.environ["FAKE_UV_LOG"])
    with log.open("a") as handle:
        handle.write(json.dumps(sys.argv[1:]) + "\\n")
    args = sys.argv[1:]
    if args[0] == "venv":
        subprocess.run([args[args.index("--python") + 1], "-m", "venv", "--without-pip", args[-1]], check=True)
    elif args[:2] == ["pip", "sync"]:
        print("Resolved 3 packages in 1ms", flush=True)
        if os.environ.get("FAKE_UV_SEEN"):
            # Read and write, so that the FIFO has a writer and select waits for the test's byte (or gives up).
            seen = os.open(os.environ["FAKE_UV_SEEN"], os.O_RDWR)
            if not select.select([seen], [], [], 60)[0]:
                print("the first line was not streamed", flush=True)
                sys.exit(3)
        print("Prepared 3 packages in 2.1s", flush=True)
        print("Installed 3 packages in 5ms", flush=True)
        sys.exit(int(os.environ.get("FAKE_UV_SYNC_EXIT", "0")))
    elif args[:2] == ["pip", "install"]:
        print("Installed 3 packages in 4ms", flush=True)
"""


@pytest.fixture
def fake_uv(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    uv = bin_dir / "uv"
    uv.write_text(textwrap.dedent(FAKE_UV).format(python=sys.executable))
    uv.chmod(uv.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_UV_LOG", str(tmp_path / "uv.log"))
    os.mkfifo(tmp_path / "seen")
    monkeypatch.setenv("FAKE_UV_SEEN", str(tmp_path / "seen"))
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "trainer.txt").write_text("absl-py==2.5.1\n    # via aqtp\njax==0.8.0\nmaxtext==0.2.5\n")
    (locks / "loader.txt").write_text("transformers==4.57.1\n")
    return uv, locks


def argvs(tmp_path: Path) -> list[list[str]]:
    import json

    return [json.loads(line) for line in (tmp_path / "uv.log").read_text().splitlines()]


class Beats:
    """A stand-in for :func:`multislice.heartbeat.heartbeat`: records each wait's name and interval, and beats
    once at its start (with its ``detail``), as the real one does after ``every`` silent seconds."""

    def __init__(self) -> None:
        self.waits: list[tuple[str, float]] = []

    @contextmanager
    def __call__(self, what, tell, every, *, detail=None):
        self.waits.append((what, every))
        tell(f"{what}: 10 s so far" + (f"; {detail()}" if detail else ""))

        class Beat:
            @staticmethod
            def tell(line: str) -> None:
                tell(line)

        yield Beat()


def test_env_install_runs_uv_as_make_env_does_and_streams_its_output(tmp_path, fake_uv):
    uv, locks = fake_uv
    told: list[str] = []
    seen = os.environ["FAKE_UV_SEEN"]

    def tell(line: str) -> None:
        told.append(line)
        if line == "  Resolved 3 packages in 1ms":  # uv is still running: its first line came before it exited
            fifo = os.open(seen, os.O_WRONLY | os.O_NONBLOCK)  # the fake uv holds the reading end
            os.write(fifo, b"1")
            os.close(fifo)

    beats = Beats()
    trainer = environment.install_trainer_env(
        tmp_path / "envs", trainer_lock=locks / "trainer.txt", loader_lock=locks / "loader.txt", tell=tell,
        beats=beats,
    )  # fmt: skip
    envs = tmp_path / "envs"
    assert trainer == envs / "trainer"
    assert argvs(tmp_path) == [
        ["venv", "--allow-existing", "--python", sys.executable, str(envs / "trainer")],
        ["pip", "sync", "--compile-bytecode", "--python", str(envs / "trainer/bin/python"), str(locks / "trainer.txt")],
        ["venv", "--allow-existing", "--python", sys.executable, str(envs / "loader-hf4")],
        ["pip", "install", "--no-deps", "--compile-bytecode", "--python", str(envs / "loader-hf4/bin/python"),
         "--requirement", str(locks / "loader.txt")],
    ]  # fmt: skip
    sync = told.index(
        f"$ {uv} pip sync --compile-bytecode --python {envs / 'trainer/bin/python'} {locks / 'trainer.txt'}"
    )
    assert told[sync + 1 : sync + 5] == [
        "uv pip sync of trainer.txt (downloads to uv's cache, then installs): 10 s so far; "
        f"0 of 3 packages installed in {envs / 'trainer/lib/python3.12/site-packages'}",
        "  Resolved 3 packages in 1ms",
        "  Prepared 3 packages in 2.1s",
        "  Installed 3 packages in 5ms",
    ]
    assert all(every <= 10 for _, every in beats.waits) and len(beats.waits) == 4
    assert told[-1] == f"trainer environment ready: export MULTISLICE_TRAINER_ENV={trainer}"
    assert (envs / "trainer/lib/python3.12/site-packages/multislice/__init__.py").is_file()


def test_a_failing_uv_step_names_its_exit_status_and_output(tmp_path, fake_uv, monkeypatch, capsys):
    _, locks = fake_uv
    monkeypatch.setenv("FAKE_UV_SYNC_EXIT", "2")
    monkeypatch.delenv("FAKE_UV_SEEN")  # no wait for the test to see the first line
    argv = ["env", "install", str(tmp_path / "envs"), "--requirements", str(locks / "trainer.txt"),
            "--loader-requirements", str(locks / "loader.txt")]  # fmt: skip
    assert cli.main(argv) == 1  # a failed run: its cause and fix, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: uv exited 2: ") and "rerun `multislice env install`" in err
    with pytest.raises(RunFailed, match=r"uv exited 2: Resolved 3 packages in 1ms\nPrepared") as raised:
        environment.install_trainer_env(tmp_path / "envs2", trainer_lock=locks / "trainer.txt",
                                        loader_lock=locks / "loader.txt", tell=lambda line: None)  # fmt: skip
    assert "rerun `multislice env install`" in raised.value.fix and "uv's cache" in raised.value.fix


def test_without_uv_anywhere_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(environment.sys, "executable", "/nonexistent/python")
    monkeypatch.setitem(sys.modules, "uv", None)  # the uv package not installed
    with pytest.raises(environment.InputError, match="no uv executable") as raised:
        environment.find_uv()
    assert "pip install uv" in raised.value.fix
