"""The Python API (what a notebook calls) raises the CLI's expected errors, cause and fix, never a client's raw one.

KFP unreachable (urllib3's ``MaxRetryError`` underneath), Vertex AI without
credentials (google-auth's ``DefaultCredentialsError``), and no trainer
environment for a wheel user (``TrainerEnvMissing``, whose fix must be one a
user without a checkout can follow: ``multislice env install``, tested here
with lock files that need no download).
"""

import subprocess
from pathlib import Path

import pytest
from google.cloud.aiplatform import initializer
from urllib3.exceptions import MaxRetryError

import multislice
from multislice import cli
from multislice.backends.local import environment
from multislice.delivery import results, submission
from multislice.errors import ConfigError, InputError, RunFailed
from tests import deployment
from tests.fakes import FakeServer

#: The packaged seed profile with a deployment's values in place of its placeholders (tests/deployment.py).
PROFILE = deployment.profile_file("gke-v6e-16x2-seed")
VALUES = {"run_name": "nightly-1", "output_dir": "gs://team-bucket/runs"}
#: Nothing listens on port 9 of the loopback (tests/conftest.py points Cloud Storage there for the same reason).
CLOSED = "http://127.0.0.1:9"


def cli_error(argv, capsys):
    """The CLI's exit status and its ``(error, fix)`` lines."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    return code, lines[-2].removeprefix("error: "), lines[-1]


def test_kfp_unreachable_is_the_clis_input_error_from_submit_and_results(capsys):
    with pytest.raises(InputError) as raised:
        multislice.submit(PROFILE, VALUES, target="kfp", kfp=submission.KfpTarget(host=CLOSED))
    error = raised.value
    assert error.message.startswith("the endpoint did not answer as expected: ") and "Max retries" in error.message
    assert "KfpTarget(host=...)" in error.fix and "--host" in error.fix
    assert isinstance(error.__cause__, MaxRetryError)  # the client's own error stays reachable
    code, cause, fix = cli_error(["submit", "--profile", PROFILE, "--target", "kfp", "--host", CLOSED,
                                  "--set", "output_dir=gs://team-bucket/runs"], capsys)  # fmt: skip
    assert code == error.exit_code == 2
    assert cause.startswith("the endpoint did not answer as expected: ") and fix == f"fix: {error.fix}"
    with pytest.raises(InputError, match="the endpoint did not answer"):
        submission.KfpTarget(host=CLOSED).make_client()  # kfp.Client reads the server's healthz


def test_a_kfp_endpoint_gone_after_the_client_was_made_is_an_input_error_from_results():
    with FakeServer() as fake:  # up while the client is made, then gone (a port-forward that ended)
        client = submission.KfpTarget(host=fake.url).make_client()
    with pytest.raises(InputError, match="the endpoint did not answer") as raised:
        results.from_kfp(client, "run-1", PROFILE, host=fake.url)
    assert "KfpTarget(host=...)" in raised.value.fix
    run = results.RunRef("nightly-1", "gs://team-bucket/runs", ["llama3-8b"], "kfp", "run-1", handle=client)
    for call in (results.state, results.wait, results.cancel):
        with pytest.raises(InputError, match="the endpoint did not answer"):
            call(run)


def test_vertex_without_credentials_is_the_clis_input_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    monkeypatch.setattr(initializer.global_config, "_credentials", None)  # none left by another test's init
    where = submission.VertexTarget(project="team-project", location="us-east5")
    with pytest.raises(InputError) as raised:
        multislice.submit(PROFILE, VALUES, target="vertex", vertex=where)
    error = raised.value
    assert error.message.startswith("no Google Cloud credentials: ") and "no-such-key.json" in error.message
    assert "gcloud auth application-default login" in error.fix
    code, cause, fix = cli_error(["submit", "--profile", PROFILE, "--target", "vertex", "--project", "team-project",
                                  "--location", "us-east5", "--set", "output_dir=gs://team-bucket/runs"],
                                 capsys)  # fmt: skip
    assert (code, cause, fix) == (2, error.message, f"fix: {error.fix}")


def test_no_trainer_environment_names_the_variable_and_a_command_a_wheel_user_can_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(tmp_path / "nowhere"))
    with pytest.raises(environment.TrainerEnvMissing) as raised:
        environment.trainer_env()
    error = raised.value
    assert f"no trainer environment (MaxText, JAX, Orbax) at {tmp_path / 'nowhere'}" in error.message
    assert f"MULTISLICE_TRAINER_ENV={tmp_path / 'nowhere'}" in error.message
    assert "multislice env install" in error.fix and "MULTISLICE_TRAINER_ENV=" in error.fix
    assert error.exit_code == 2


def test_the_lock_files_env_install_uses_ship_with_the_package():
    # links to requirements/ in the checkout; the wheel holds the files (tests/test_notebook.py builds one)
    assert environment.TRAINER_LOCK.read_text() == (environment.PROJECT_ROOT / "requirements/trainer.txt").read_text()
    assert "maxtext==0.2.5" in environment.TRAINER_LOCK.read_text()
    assert "transformers==4.57" in environment.LOADER_HF4_LOCK.read_text()


def test_env_install_builds_a_trainer_environment_the_local_backend_accepts(tmp_path, monkeypatch, capsys):
    """``multislice env install`` end to end but for the download: lock files of no package (offline)."""
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "trainer.txt").write_text("# no pins: nothing to download\n")
    (locks / "loader.txt").write_text("# no pins\n")
    argv = ["env", "install", str(tmp_path / "envs"), "--requirements", str(locks / "trainer.txt"),
            "--loader-requirements", str(locks / "loader.txt")]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    trainer = tmp_path / "envs" / "trainer"
    assert f"pip sync --compile-bytecode --python {trainer / 'bin' / 'python'} {locks / 'trainer.txt'}" in out
    assert out.strip().endswith(f"trainer environment ready: export MULTISLICE_TRAINER_ENV={trainer}")
    monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(trainer))
    assert environment.trainer_env() == trainer
    code = "import multislice.trainer, importlib.metadata as m, multislice; print(multislice.__file__, " \
           "m.version('multislice-pipelines'))"  # fmt: skip
    for python in (trainer / "bin" / "python", tmp_path / "envs" / "loader-hf4" / "bin" / "python"):
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                              env={"PATH": "/usr/bin:/bin"})  # fmt: skip
        assert done.returncode == 0, done.stderr
        where, version = done.stdout.split()
        assert where.startswith(str(trainer)) and version == "0.1.0"  # the copy, not this checkout


@pytest.mark.skipif(not Path("/usr/bin/python3.11").exists(), reason="needs a Python other than 3.12")
def test_env_install_refuses_a_python_that_is_not_3_12(tmp_path):
    with pytest.raises(InputError, match=r"/usr/bin/python3\.11 is Python 3\.11, not 3\.12") as raised:
        environment.install_trainer_env(tmp_path / "envs", python="/usr/bin/python3.11")
    assert "--python" in raised.value.fix and not (tmp_path / "envs").exists()


def test_run_local_without_a_trainer_environment_raises_the_clis_cause_and_fix(tmp_path, monkeypatch):
    """``multislice.run_local`` is ``multislice run``: its lines told as printed, its failure as a UserError."""
    monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(tmp_path / "nowhere"))
    told = []
    with pytest.raises(RunFailed) as raised:
        multislice.run_local("local", {"output_dir": str(tmp_path / "runs"), "run_name": "no-env"}, tell=told.append)
    error = raised.value
    assert error.message.startswith("local run no-env failed: ") and "TrainerEnvMissing: no trainer environment" in (
        error.message)  # fmt: skip
    assert "multislice env install" in error.fix and "MULTISLICE_TRAINER_ENV" in error.fix
    assert "run no-env: FAILED in " in "\n".join(told) and told[-1].startswith("see ")  # the CLI's own lines
    # the run directory it left is found from its plan report alone (what the notebook's MULTISLICE_LOCAL_RUNS reads)
    found = results.from_run_dir(str(tmp_path / "runs"), "no-env")
    assert (found.run_name, found.stages, found.target) == ("no-env", ["tiny-8b-recipe", "tiny-70b-recipe"], "local")
    assert results.stages(found)[0]["status"] == "not reached"
    with pytest.raises(InputError, match="no run directory"):
        results.from_run_dir(str(tmp_path / "runs"), "other")


def test_run_local_refuses_a_bad_change_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="maxtext_overrides.cosine_learning_rate_final_fraction"):
        bad = {"stages.0.maxtext_overrides.cosine_learning_rate_final_fraction": 1.0}
        multislice.run_local("local", {"output_dir": str(tmp_path), "run_name": "bad", **bad})
    assert list(tmp_path.iterdir()) == []
