"""Failure notification: the exit handler posts the final status, failed step and error to a loopback webhook."""

import contextlib
import json
from pathlib import Path

import pytest

from multislice import config
from multislice.delivery import notify
from multislice.steps import cleanup
from tests.fakes import FakeServer


def _run_dir_with_reports(tmp_path, done):
    """A local run directory whose reports say which steps finished (``done``: (stage or None, file) pairs)."""
    spec = config.load_profile("local", {"output_dir": str(tmp_path), "run_name": "nightly"})
    plan = {"plan": {"stages": [{"name": s.name} for s in spec.stages]}}
    reports = tmp_path / "nightly" / "reports"
    for stage, name in done:
        path = reports / stage / f"{name}.json" if stage else reports / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        verdict = {"preflight": "fits", "verification": "PASS"}.get(name)
        path.write_text(json.dumps(plan if name == "plan" else {"verdict": verdict} if verdict else {}))
    return str(tmp_path / "nightly"), [s.name for s in spec.stages]


BEFORE_PROVISION = [(stage, step) for stage in ("tiny-8b-recipe", "tiny-70b-recipe") for step in ("plan", "preflight")]


def test_failed_step_from_local_reports(tmp_path):
    run_dir, (s1, s2) = _run_dir_with_reports(tmp_path, [])
    assert notify.failed_step_from_reports(run_dir) == "plan"
    _run_dir_with_reports(tmp_path, [(s1, "plan"), (s2, "plan"), (s1, "preflight")])
    assert notify.failed_step_from_reports(run_dir) == f"preflight {s2}"
    _run_dir_with_reports(tmp_path, BEFORE_PROVISION)
    assert notify.failed_step_from_reports(run_dir) == "provision"
    _run_dir_with_reports(tmp_path, [(None, "provision"), (s1, "admit"), (s1, "launch")])
    assert notify.failed_step_from_reports(run_dir) == f"train {s1}"
    _run_dir_with_reports(tmp_path, [(s1, "train")])
    Path(run_dir, "reports", s1, "verification.json").write_text(json.dumps({"verdict": "FAIL"}))
    assert notify.failed_step_from_reports(run_dir) == f"verify_checkpoint {s1}"  # written before its FAIL raised
    Path(run_dir, "reports", s1, "verification.json").write_text(json.dumps({"verdict": "PASS"}))
    assert notify.failed_step_from_reports(run_dir) == f"admit {s2}"


def test_a_stage_that_does_not_fit_is_the_failed_step(tmp_path):
    run_dir, (s1, s2) = _run_dir_with_reports(tmp_path, [(s1, "plan") for s1 in ("tiny-8b-recipe", "tiny-70b-recipe")])
    for stage, verdict in ((s1, "fits"), (s2, "does_not_fit")):  # preflight writes every report, then raises
        Path(run_dir, "reports", stage, "preflight.json").write_text(json.dumps({"verdict": verdict}))
    assert notify.failed_step_from_reports(run_dir) == f"preflight {s2}"


def test_failed_step_from_the_orchestrator_message(tmp_path):
    message = "The DAG failed because some tasks failed. The failed tasks are: [train-2]."
    assert notify.failed_step(message, None) == "train-2"  # no plan report to map it with
    assert notify.failed_step("Task exit-handler-1 failed.", str(tmp_path / "no-run")) == "plan"


def test_cleanup_posts_slack_compatible_status(tmp_path):
    run_dir, (s1, s2) = _run_dir_with_reports(tmp_path, [])
    _run_dir_with_reports(tmp_path, [*BEFORE_PROVISION, (None, "provision"), (s1, "admit")])
    with FakeServer() as hook:
        result = cleanup.run("local", str(tmp_path), "nightly", "run-uuid", "FAILED",
                             notify_webhook_url=f"{hook.url}/hook/T0/B0", error_message="Task exit-handler-1 failed.",
                             pipeline_job="local-pipeline-exit-handler-1")  # fmt: skip
        [posted] = hook.state.hooks
        [request] = hook.state.requests
    assert request.method == "POST" and request.headers["Content-Type"] == "application/json"
    assert posted == {
        "text": f":x: multislice run `nightly` FAILED at step `launch {s1}`\n> Task exit-handler-1 failed.\n"
        "pipeline job: local-pipeline-exit-handler-1",
        "status": "FAILED", "backend_state": "FAILED", "run_name": "nightly", "failed_step": f"launch {s1}",
        "error": "Task exit-handler-1 failed.", "pipeline_job": "local-pipeline-exit-handler-1",
    }  # fmt: skip
    assert result.notified is True and result.failed_step == f"launch {s1}"


def test_unique_run_name_and_success_message(tmp_path):
    with FakeServer() as hook:
        result = cleanup.run("local", str(tmp_path), "nightly", "ab12cd34-0000", "SUCCEEDED", unique_run_name=True,
                             notify_webhook_url=f"{hook.url}/hook")  # fmt: skip
        [posted] = hook.state.hooks
    assert posted["text"] == ":white_check_mark: multislice run `nightly-ab12cd34` SUCCEEDED"
    assert posted["failed_step"] is None and result.notified is True


def test_a_failing_webhook_does_not_fail_cleanup(tmp_path):
    with FakeServer() as hook:
        hook.state.hook_status = 500
        result = cleanup.run("local", str(tmp_path), "nightly", "x", "FAILED", notify_webhook_url=f"{hook.url}/hook")
    assert result.notified.startswith("webhook answered HTTP 500")
    result = cleanup.run("local", str(tmp_path), "nightly", "x", "FAILED", notify_webhook_url="http://127.0.0.1:9/x")
    assert result.notified.startswith("webhook post failed")


def test_no_webhook_no_post(tmp_path):
    result = cleanup.run("local", str(tmp_path), "nightly", "x", "FAILED")
    assert result.notified is None


class _ApiDown:
    """A backend whose API keeps failing while cleanup lists what the run left (and claims the notification,
    and ends the run's hold: the run Lease's renewals fail and are told, as ``lease.RunHolder`` does)."""

    def _down(self, *args, **kwargs):
        from multislice.backends.gke.retry import ApiUnavailable

        raise ApiUnavailable("list JobSets kept failing for 300 s, last with HTTP 503", "check the API server")

    cleanup = claim_notification = end_run = release_node_pools = _down

    @contextlib.contextmanager
    def holding_run(self, run_name, run_dir, pipeline_run_id, step, tell):
        tell("could not renew Lease multislice-run-x: HTTP 503")
        yield None


def test_cleanup_notifies_even_when_the_api_is_down_then_fails(tmp_path):
    from multislice.backends.gke.retry import ApiUnavailable

    with FakeServer() as hook:
        with pytest.raises(ApiUnavailable, match="HTTP 503"):
            cleanup.run("gke", str(tmp_path), "nightly", "x", "FAILED", backend=_ApiDown(),
                        notify_webhook_url=f"{hook.url}/hook")  # fmt: skip
        [posted] = hook.state.hooks
    assert posted["status"] == "FAILED"
    written = json.loads((tmp_path / "nightly" / "reports" / "cleanup.json").read_text())
    assert "HTTP 503" in written["error"] and written["notified"] is True


# The final status as each backend really hands it to the exit handler (PipelineTaskFinalStatus fields):
# Vertex AI: PipelineTaskDetail.State names and the DAG's error message naming IR task names;
# the KFP 2.14-2.17 driver: the MLMD execution state (COMPLETE / FAILED / CANCELED) and an empty error message.
VERTEX_DAG_ERROR = "The DAG failed because some tasks failed. The failed tasks are: [train-2]."
BACKEND_STATUSES = [
    pytest.param("vertex", "SUCCEEDED", None, "SUCCEEDED", None, id="vertex-succeeded"),
    pytest.param("vertex", "FAILED", VERTEX_DAG_ERROR, "FAILED", "train {s2}", id="vertex-failed"),
    pytest.param("vertex", "CANCELLED", "The pipeline job was cancelled.", "CANCELLED", "train {s1}",
                 id="vertex-cancelled"),
    pytest.param("kfp", "COMPLETE", "", "SUCCEEDED", None, id="kfp-complete"),
    pytest.param("kfp", "FAILED", "", "FAILED", "train {s1}", id="kfp-failed"),
    pytest.param("kfp", "CANCELED", "", "CANCELLED", "train {s1}", id="kfp-canceled"),
]  # fmt: skip


@pytest.mark.parametrize(("backend", "state", "error", "status", "step"), BACKEND_STATUSES)
def test_exit_handler_reports_each_backends_final_state(tmp_path, backend, state, error, status, step):
    run_dir, (s1, s2) = _run_dir_with_reports(tmp_path, BEFORE_PROVISION)
    _run_dir_with_reports(tmp_path, [(None, "provision"), (s1, "admit"), (s1, "launch")])  # stopped in train s1
    step = step.format(s1=s1, s2=s2) if step else None
    with FakeServer() as hook:
        result = cleanup.run("local", str(tmp_path), "nightly", "run-uuid", state, error_message=error,
                             notify_webhook_url=f"{hook.url}/hook",
                             pipeline_job=f"projects/p/locations/l/pipelineJobs/{backend}-run")  # fmt: skip
        [posted] = hook.state.hooks
    assert posted["status"] == status and posted["backend_state"] == state
    assert posted["failed_step"] == step and result.failed_step == step
    assert posted["text"].startswith(f"{notify.status_payload('nightly', state)['text']}")
    assert "?" not in posted["text"].split("\n")[0] and ":grey_question:" not in posted["text"]
    if step:
        assert f"at step `{step}`" in posted["text"]
    assert posted["error"] == (error or None)


def test_states_normalize_and_task_names_map_to_steps():
    assert [notify.normalize_state(s) for s in ("COMPLETE", "SUCCEEDED", "CANCELED", "CANCELLED", "FAILED")] == [
        "SUCCEEDED", "SUCCEEDED", "CANCELLED", "CANCELLED", "FAILED",
    ]  # fmt: skip
    assert notify.normalize_state("") == "UNKNOWN"
    stages = ["a", "b"]
    assert notify.step_of_task("train", stages) == "train a"
    assert notify.step_of_task("verify-checkpoint-2", stages) == "verify_checkpoint b"
    assert notify.step_of_task("provision", stages) == "provision"
    assert notify.step_of_task("train-3", stages) == "train-3"  # no third stage: the name as given
    assert notify.step_of_task("exit-handler-1", stages) == "exit-handler-1"


# ---------------------------------------------------------------- the webhook URL is a secret

SECRET_URL = "https://hooks.slack.com/services/T0/B0/s3cr3t-t0k3n"
SECRET_NAME = "projects/team-project/secrets/multislice-webhook/versions/latest"


def test_no_secret_value_in_either_compiled_target(tmp_path, monkeypatch):
    """Problem 7: compile with a webhook set (environment and a Secret Manager reference): no value in the YAML."""
    import yaml

    from pipelines.multislice_training import compile_pipeline

    monkeypatch.setenv(notify.WEBHOOK_ENV, SECRET_URL)
    profile = {**config.read_profile("gke-v6e-16x2-seed"), "notify_webhook_secret": SECRET_NAME}
    texts = {}
    for target in ("kfp", "vertex"):
        path = compile_pipeline(profile, str(tmp_path / f"{target}.yaml"), target=target)
        texts[target] = Path(path).read_text()
        assert "s3cr3t" not in texts[target] and "hooks.slack.com" not in texts[target]
        assert "notify_webhook_url" not in texts[target]
    platform = list(yaml.safe_load_all(texts["kfp"]))[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert platform["exec-cleanup"]["secretAsEnv"] == [
        {"secretName": "multislice-notify-webhook", "keyToEnv": [{"secretKey": "url", "envVar": notify.WEBHOOK_ENV}],
         "optional": True, "secretNameParameter": {"runtimeValue": {"constant": "multislice-notify-webhook"}}}
    ]  # fmt: skip
    assert not any("secretAsEnv" in e for name, e in platform.items() if name != "exec-cleanup")
    with pytest.raises(config.ConfigError, match="notify_webhook_url"):  # the old plain parameter is gone
        config.load_spec({**config.read_profile("gke-v6e-16x2-seed"), "notify_webhook_url": SECRET_URL})
    with pytest.raises(config.ConfigError) as refused:  # a URL where the reference goes is refused, not echoed
        config.load_spec(profile, {"notify_webhook_secret": SECRET_URL})
    assert "store it in Secret Manager" in str(refused.value) and "s3cr3t" not in str(refused.value)


def test_kfp_exit_handler_takes_the_url_from_the_kubernetes_secret_env(tmp_path, monkeypatch):
    with FakeServer() as hook:
        monkeypatch.setenv(notify.WEBHOOK_ENV, f"{hook.url}/hook")
        result = cleanup.run("local", str(tmp_path), "nightly", "x", "COMPLETE")
        [posted] = hook.state.hooks
    assert posted["status"] == "SUCCEEDED" and result.notified is True


def test_vertex_exit_handler_reads_the_url_from_secret_manager(tmp_path, monkeypatch):
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.delenv(notify.WEBHOOK_ENV, raising=False)
    with FakeServer() as server:
        monkeypatch.setattr(notify, "SECRET_MANAGER_ENDPOINT", server.url)
        monkeypatch.setattr("google.auth.default", lambda scopes=None: (AnonymousCredentials(), "team-project"))
        server.state.secrets[SECRET_NAME] = f"{server.url}/hook\n".encode()
        result = cleanup.run("local", str(tmp_path), "nightly", "x", "FAILED", notify_webhook_secret=SECRET_NAME,
                             error_message=VERTEX_DAG_ERROR)  # fmt: skip
        [posted] = server.state.hooks
        assert posted["status"] == "FAILED" and result.notified is True
        [access] = server.state.sent("GET", ":access")
        assert access.path == f"/v1/{SECRET_NAME}:access"
        missing = SECRET_NAME.replace("multislice-webhook", "absent")
        assert notify.webhook_url(missing) == (None, f"Secret Manager answered HTTP 404 for {missing}")
        server.state.secrets[SECRET_NAME] = b"not a url"
        assert notify.webhook_url(SECRET_NAME) == (None, "the webhook secret does not hold an http(s) URL")
