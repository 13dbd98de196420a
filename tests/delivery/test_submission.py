"""Submit: parameters validated before any request; Vertex AI PipelineJob bodies and KFP API requests as sent."""

import re
import warnings
from unittest import mock

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud.aiplatform_v1.services.pipeline_service.transports import grpc as pipeline_grpc
from google.cloud.aiplatform_v1.types import pipeline_job as gca_pipeline_job

import multislice
from multislice import cli, config
from multislice.config import ConfigError
from multislice.delivery import submission, targets
from tests import deployment
from tests.fakes import FakeServer

warnings.filterwarnings("ignore", category=FutureWarning)

#: The packaged seed profile with a deployment's values in place of its placeholders (tests/deployment.py).
PROFILE = deployment.profile_file("gke-v6e-16x2-seed")
EXPECTED = {
    "run_name": "nightly-1", "tpu_type": "v6e-16", "machine_type": "", "num_slices": 2,
    "output_dir": "gs://team-bucket/runs", "trainer_image": deployment.TRAINER_IMAGE, "namespace": "default",
    "queue": "multislice-queue", "priority": "default-priority", "max_restarts": 4, "launcher": "jobset",
    "skip_preflight": False,
    "unique_run_name": False, "notify_webhook_secret": "", "stage1_steps": 100, "stage1_per_device_batch_size": 4.0,
    "stage2_steps": 200, "stage2_per_device_batch_size": 1.0, "cluster_project": "team-project",
    "cluster_location": "us-east5", "cluster_name": "team-cluster", "cluster_access": "gke", "zone": "us-east5-b",
    "pipeline_service_account": "multislice-pipeline", "trainer_service_account": "multislice-trainer",
}  # fmt: skip
VALUES = {"run_name": "nightly-1", "output_dir": "gs://team-bucket/runs", "stage1_steps": 100}


@pytest.fixture
def fake(monkeypatch):
    with FakeServer() as server:
        # google-cloud-storage (aiplatform's pipeline-root bucket check) talks to the fake instead of GCS.
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        yield server


class VertexTransport:
    """Stands in for the final gRPC call PipelineService.CreatePipelineJob; records the request."""

    def __init__(self):
        self.requests = []

    def __call__(self, request, **kwargs):
        from google.api_core import exceptions

        if any(r.pipeline_job_id == request.pipeline_job_id for r in self.requests):  # job IDs are unique
            raise exceptions.AlreadyExists(f"PipelineJob {request.pipeline_job_id} already exists")
        self.requests.append(request)
        job = gca_pipeline_job.PipelineJob(request.pipeline_job)
        job.name = f"{request.parent}/pipelineJobs/{request.pipeline_job_id}"
        return job

    def patch(self):
        return mock.patch.object(
            pipeline_grpc.PipelineServiceGrpcTransport, "create_pipeline_job", new_callable=mock.PropertyMock,
            return_value=self,
        )  # fmt: skip


def vertex_target(**kwargs):
    return submission.VertexTarget(project="team-project", location="us-east5", credentials=AnonymousCredentials(),
                                   **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("values", "field", "words"),
    [
        ({"stage1_stepz": 5}, "stage1_stepz", "unknown pipeline parameter"),
        ({"num_slices": "two"}, "num_slices", "expected an integer"),
        ({"unique_run_name": "yes"}, "unique_run_name", "expected true or false"),
        ({"stage1_per_device_batch_size": True}, "stage1_per_device_batch_size", "expected a number"),
        ({"stage1_steps": 0}, "stages[0] (llama3-8b).steps", "greater than 0"),
        ({"notify_webhook_secret": "https://hooks.example/T0"}, "notify_webhook_secret", "store it in Secret Manager"),
        ({"backend": "local", "output_dir": "/data/runs"}, "backend", "set backend=gke"),
    ],
)
def test_bad_parameters_are_refused_before_any_request(fake, values, field, words):
    transport = VertexTransport()
    with transport.patch(), pytest.raises(ConfigError) as raised:
        multislice.submit(PROFILE, values, target="vertex", vertex=vertex_target())
    with pytest.raises(ConfigError):
        multislice.submit(PROFILE, values, target="kfp", kfp=submission.KfpTarget(host=fake.url))
    assert [f for f, _ in raised.value.issues] == [field]
    assert words in raised.value.issues[0][1]
    assert transport.requests == [] and fake.state.requests == []


def test_vertex_compile_target_is_one_document_and_builds_a_pipeline_job_offline(tmp_path):
    data = config.read_profile(PROFILE)
    spec, arguments = submission.validate_parameters(data, VALUES)
    path = submission.compile_for(data, "vertex", tmp_path)
    assert len(targets.documents(path)) == 1
    assert len(targets.documents(submission.compile_for(data, "kfp", tmp_path))) == 2  # + kubernetes platform config
    job = submission.vertex_job(path, spec, arguments, vertex_target())
    body = job.to_dict()
    assert body["runtimeConfig"]["gcsOutputDirectory"] == "gs://team-bucket/runs/pipeline-root"
    assert body["runtimeConfig"]["parameterValues"] == EXPECTED
    assert body["displayName"] == "nightly-1" and body["labels"] == {"multislice-pipeline": "multislice-training"}
    assert body["pipelineSpec"]["pipelineInfo"]["name"] == "multislice-training"


def test_vertex_needs_a_gcs_pipeline_root():
    data = config.read_profile(PROFILE)
    spec, arguments = submission.validate_parameters(data, VALUES)
    with pytest.raises(ConfigError) as raised:
        submission.vertex_job("unused.yaml", spec, arguments, vertex_target(pipeline_root="/mnt/root"))
    assert raised.value.issues[0][0] == "pipeline_root"


def test_submit_to_vertex_sends_the_pipeline_job(fake):
    transport = VertexTransport()
    where = vertex_target(service_account="runner@team-project.iam.gserviceaccount.com",
                          network="projects/123/global/networks/tpu-vpc", labels={"team": "ml-platform"})  # fmt: skip
    with transport.patch():
        run = multislice.submit(PROFILE, VALUES, target="vertex", vertex=where)
    [request] = transport.requests
    assert request.parent == "projects/team-project/locations/us-east5"
    assert re.fullmatch(r"nightly-1-[0-9a-f]{8}", request.pipeline_job_id)
    assert request.pipeline_job.display_name == "nightly-1"
    sent = gca_pipeline_job.PipelineJob.to_dict(request.pipeline_job)
    assert sent["service_account"] == "runner@team-project.iam.gserviceaccount.com"
    assert sent["network"] == "projects/123/global/networks/tpu-vpc"
    assert sent["labels"] == {"multislice-pipeline": "multislice-training", "team": "ml-platform"}
    assert sent["runtime_config"]["gcs_output_directory"] == "gs://team-bucket/runs/pipeline-root"
    assert sent["runtime_config"]["parameter_values"] == EXPECTED
    assert run.run_id == f"projects/team-project/locations/us-east5/pipelineJobs/{request.pipeline_job_id}"
    # Besides the PipelineJob, the SDK only reads the pipeline root's bucket (exists, then ownership).
    assert {(r.method, r.path) for r in fake.state.requests} == {("GET", "/storage/v1/b/team-bucket")}


def test_submit_to_kfp_uploads_then_versions_then_runs(fake):
    where = submission.KfpTarget(host=fake.url, experiment="llama", service_account="pipeline-runner")
    first = multislice.submit(PROFILE, VALUES, target="kfp", kfp=where)
    second = multislice.submit(PROFILE, {**VALUES, "run_name": "nightly-2"}, target="kfp", kfp=where)
    state = fake.state
    assert len(state.sent("POST", "/pipelines/upload")) == 1  # the pipeline once
    # One version per content: the second submission of the unchanged YAML reuses it.
    [version] = state.sent("POST", "/pipelines/upload_version")
    assert re.fullmatch(r"multislice-training-0-1-0-[0-9a-f]{12}", version.query["name"])
    assert version.query["pipelineid"] == first.pipeline_id and second.version_id == first.version_id
    assert len(state.sent("POST", "/experiments")) == 1
    runs = [r.body for r in state.sent("POST", "/runs")]
    assert runs[0]["runtime_config"] == {"parameters": EXPECTED}
    assert runs[1]["runtime_config"]["parameters"]["run_name"] == "nightly-2"
    assert runs[0]["display_name"] == "nightly-1" and runs[0]["service_account"] == "pipeline-runner"
    assert runs[0]["pipeline_version_reference"] == {"pipeline_id": first.pipeline_id,
                                                     "pipeline_version_id": first.version_id}  # fmt: skip
    [(experiment_id, experiment)] = state.experiments.items()
    assert (
        experiment["display_name"] == "llama" and runs[0]["experiment_id"] == runs[1]["experiment_id"] == experiment_id
    )
    uploaded = state.templates[first.version_id]
    assert len(uploaded) == 2 and "platforms" in uploaded[1]  # the kfp target: with kubernetes platform config
    assert uploaded[0]["root"]["inputDefinitions"]["parameters"]["stage1_steps"]["defaultValue"] == 200
    assert second.run_id != first.run_id


def test_runs_get_unique_names_unless_given(fake):
    where = submission.KfpTarget(host=fake.url)
    with mock.patch.object(submission, "default_run_name", side_effect=["llama3-multislice-a", "llama3-multislice-b"]):
        names = [multislice.submit(PROFILE, {"output_dir": "gs://bucket/r"}, target="kfp", kfp=where).run_name
                 for _ in range(2)]  # fmt: skip
    assert names == ["llama3-multislice-a", "llama3-multislice-b"]
    stamp = submission.default_run_name("base")
    assert stamp.startswith("base-20") and len(stamp) == len("base-20261122-101500")


def test_cli_submit_kfp(fake, capsys):
    status = cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set",
                       "run_name=cli-run", "--set", "output_dir=gs://bucket/r", "--set", "max_restarts=1"])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    [run] = fake.state.sent("POST", "/runs")
    assert run.body["runtime_config"]["parameters"]["max_restarts"] == 1
    assert "submitted run cli-run to kfp" in capsys.readouterr().out


def _no_client(*args, **kwargs):
    raise AssertionError("a dry run built a client")


def test_cli_submit_dry_run_checks_and_compiles_but_sends_nothing(fake, capsys, monkeypatch):
    monkeypatch.setattr(submission.KfpTarget, "make_client", _no_client)
    status = cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set", "run_name=dry",
                       "--set", "output_dir=gs://bucket/r", "--set", "stage1_steps=10", "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and fake.state.requests == []
    assert out.startswith("dry run: run dry would be submitted to kfp; nothing was sent")
    # The profile's checkpoint_period 50 follows the 10 steps (the plan step applies the same rule).
    assert "note: stage 1 llama3-8b: checkpoint_period follows steps=10 (the profile's 50 exceeds it" in out
    assert re.search(r"pipeline: multislice-training, version multislice-training-[-0-9a-z]+-[0-9a-f]{12} ", out)
    assert f"  host:                 {fake.url}\n" in out and "  experiment:           multislice\n" in out
    assert "  stage1_steps = 10\n" in out and "  run_name = 'dry'\n" in out
    # What a real submission refuses, a dry run refuses too, before compiling.
    assert cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set", "num_slices=two",
                     "--dry-run"]) == 2  # fmt: skip
    assert "num_slices: expected an integer" in capsys.readouterr().err
    assert fake.state.requests == []


def test_vertex_dry_run_needs_no_credentials_and_says_what_the_job_would_be(monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/key.json")  # any client would fail on it
    where = submission.VertexTarget(project="team-project", location="us-east5", labels={"team": "ml"})
    request = submission.dry_run(PROFILE, VALUES, target="vertex", vertex=where)
    assert request.parameters == EXPECTED and request.run_name == "nightly-1"
    assert request.settings["pipeline root"] == "gs://team-bucket/runs/pipeline-root"
    assert request.settings["labels"] == {"multislice-pipeline": "multislice-training", "team": "ml"}
    assert request.template_bytes > 10_000
    with pytest.raises(ConfigError, match="--pipeline-root: '' is not a Cloud Storage bucket name"):
        submission.dry_run(PROFILE, VALUES, target="vertex", vertex=vertex_target(pipeline_root="gs://"))


def test_kfp_clients_version_warning_stays_off_the_terminal(fake):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = submission.KfpTarget(host=fake.url).make_client()
    assert client is not None
    assert not [w for w in caught if "only works with Kubeflow Pipeline" in str(w.message)]


def test_cli_submit_refuses_bad_parameter_before_sending(fake, capsys):
    status = cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url,
                       "--set", "num_slices=two"])  # fmt: skip
    assert status == 2
    assert "num_slices: expected an integer" in capsys.readouterr().err
    assert fake.state.requests == []


def test_cli_submit_vertex_needs_project_and_location(capsys):
    assert cli.main(["submit", "--profile", PROFILE, "--target", "vertex"]) == 2
    err = capsys.readouterr().err
    assert "--project: required with --target vertex" in err and "--location" in err


@pytest.mark.parametrize(("tag", "words"), [("2.13.1", "older than 2.14.0"), ("2.5.0", "older than 2.14.0"),
                                            ("unknown", "not X.Y.Z")])  # fmt: skip
def test_kfp_server_older_than_2_14_is_refused_before_anything_is_uploaded(fake, tag, words):
    fake.state.kfp_version = tag
    where = submission.KfpTarget(host=fake.url)
    with pytest.raises(submission.KfpBackendTooOld) as raised:
        multislice.submit(PROFILE, VALUES, target="kfp", kfp=where)
    assert words in str(raised.value)
    assert {(r.method, r.path) for r in fake.state.requests} == {("GET", "/apis/v2beta1/healthz")}


def test_kfp_server_2_14_is_accepted_and_the_check_can_be_skipped(fake):
    fake.state.kfp_version = "2.14.0"
    assert multislice.submit(PROFILE, VALUES, target="kfp", kfp=submission.KfpTarget(host=fake.url)).run_id
    fake.state.kfp_version = "unknown"
    where = submission.KfpTarget(host=fake.url, check_version=False)
    assert multislice.submit(PROFILE, VALUES, target="kfp", kfp=where).run_id


def test_kfp_submit_in_a_namespace_uploads_and_finds_the_pipeline_there(fake):
    where = submission.KfpTarget(host=fake.url, namespace="team-a")
    first = multislice.submit(PROFILE, VALUES, target="kfp", kfp=where)
    second = multislice.submit(PROFILE, VALUES, target="kfp", kfp=where)
    [upload] = fake.state.sent("POST", "/pipelines/upload")
    assert upload.query["namespace"] == "team-a"
    assert first.pipeline_id == second.pipeline_id and first.version_id == second.version_id
    [experiment] = fake.state.experiments.values()
    assert experiment["namespace"] == "team-a"


def test_a_changed_pipeline_gets_a_new_version(fake):
    where = submission.KfpTarget(host=fake.url)
    first = multislice.submit(PROFILE, VALUES, target="kfp", kfp=where)
    changed = config.apply_overrides(config.read_profile(PROFILE), {"queue": "other-queue"})
    second = multislice.submit(changed, VALUES, target="kfp", kfp=where)
    assert second.pipeline_id == first.pipeline_id and second.version_id != first.version_id


@pytest.mark.parametrize(
    ("pairs", "words"),
    [
        (["Team=ml"], "starting with a letter"),
        (["1team=ml"], "starting with a letter"),
        (["team=ML"], "lowercase"),
        (["team=a.b"], "lowercase"),
        ([f"k={'x' * 64}"], "at most 63"),
        (["team"], "is not KEY=VALUE"),
        ([f"k{i}=v" for i in range(65)], "at most 64"),
    ],
)
def test_labels_breaking_vertex_rules_are_refused_before_any_request(fake, capsys, pairs, words):
    arguments = [a for pair in pairs for a in ("--label", pair)]
    transport = VertexTransport()
    with transport.patch():
        status = cli.main(["submit", "--profile", PROFILE, "--target", "vertex", "--project", "team-project",
                           "--location", "us-east5", "--set", "output_dir=gs://bucket/r", *arguments])  # fmt: skip
    assert status == 2
    assert words in capsys.readouterr().err
    assert transport.requests == [] and fake.state.requests == []


def test_labels_are_strings_as_written():
    assert submission.parse_labels(["flag=true", "n=007", "empty=", "run_id=a-b_c"]) == {
        "flag": "true", "n": "007", "empty": "", "run_id": "a-b_c"
    }  # fmt: skip
    with pytest.raises(ConfigError):
        submission.check_labels({"n": 7})


def test_a_second_run_with_defaults_and_the_same_run_name_twice_succeed_on_both_targets(fake):
    """Problem 4: neither a rerun with the defaults nor the same explicit run_name collides on KFP or Vertex AI."""
    kfp = submission.KfpTarget(host=fake.url)
    runs = [multislice.submit(PROFILE, {"output_dir": "gs://bucket/r"}, target="kfp", kfp=kfp) for _ in range(2)]
    runs += [multislice.submit(PROFILE, VALUES, target="kfp", kfp=kfp) for _ in range(2)]
    versions = [v.query["name"] for v in fake.state.sent("POST", "/pipelines/upload_version")]
    assert len(set(versions)) == len(versions) and len({r.run_id for r in runs}) == 4  # no version name twice
    transport = VertexTransport()
    with transport.patch():
        jobs = [multislice.submit(PROFILE, VALUES, target="vertex", vertex=vertex_target()) for _ in range(2)]
    assert len({r.pipeline_job_id for r in transport.requests}) == 2 and jobs[0].run_id != jobs[1].run_id
    assert {r.pipeline_job.display_name for r in transport.requests} == {"nightly-1"}


def test_continue_is_explicit_and_keeps_the_earlier_run_name(fake, capsys):
    kfp = submission.KfpTarget(host=fake.url)
    run = multislice.submit(
        PROFILE, {"output_dir": "gs://bucket/r"}, target="kfp", kfp=kfp, continue_run="nightly-ab12"
    )
    assert run.parameters["run_name"] == "nightly-ab12" and run.parameters["unique_run_name"] is False
    with pytest.raises(ConfigError, match="contradicts --continue"):
        submission.prepare(config.read_profile(PROFILE), {"run_name": "other"}, "kfp", continue_run="nightly-ab12")
    status = cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set",
                       "output_dir=gs://bucket/r", "--continue", "Not_A_Run"])  # fmt: skip
    assert status == 2 and "is not a run name" in capsys.readouterr().err
    status = cli.main(["submit", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set",
                       "output_dir=gs://bucket/r", "--continue", "nightly-ab12"])  # fmt: skip
    assert status == 0 and "submitted run nightly-ab12 to kfp" in capsys.readouterr().out


def test_the_compiled_pipeline_makes_each_run_new_by_default(tmp_path):
    import yaml

    path = submission.compile_for(config.read_profile(PROFILE), "kfp", tmp_path)
    spec = next(yaml.safe_load_all(path.read_text()))
    assert spec["root"]["inputDefinitions"]["parameters"]["unique_run_name"]["defaultValue"] is True


@pytest.mark.parametrize("target", ["kfp", "vertex"])
def test_idempotent_steps_get_a_retry_policy_on_both_targets(tmp_path, target):
    import yaml

    from pipelines.multislice_training import compile_pipeline

    path = compile_pipeline(config.read_profile(PROFILE), str(tmp_path / "p.yaml"), target=target)
    tasks = next(yaml.safe_load_all(open(path)))["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    retried = {name for name, task in tasks.items() if "retryPolicy" in task}
    steps = ("prepare-data", "preflight", "admit", "launch", "train", "verify-checkpoint")
    assert retried == {f"{step}{suffix}" for step in steps for suffix in ("", "-2")} | {"provision"}
    assert tasks["train"]["retryPolicy"] == {"maxRetryCount": 2, "backoffDuration": "60s", "backoffFactor": 2.0,
                                             "backoffMaxDuration": "600s"}  # fmt: skip
    local = compile_pipeline(config.read_profile(PROFILE), str(tmp_path / "l.yaml"), target=target, retries=False)
    assert "retryPolicy" not in open(local).read()


PLACEHOLDERS = ["output_dir", "cluster_project", "cluster_name", "service_accounts.trainer_gcp_service_account",
                "trainer_image", "images.pipeline"]  # fmt: skip


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled before refusing")


@pytest.mark.parametrize("dry_run", [False, True])
def test_submit_refuses_the_profiles_placeholders_naming_each_and_its_fix_before_compiling(
    fake, capsys, monkeypatch, dry_run
):
    """Issue 44: the packaged profile's your-bucket, your-project, your-cluster and unbuilt images went out."""
    monkeypatch.setattr(submission, "compile_for", _no_compile)
    flags = ["--dry-run"] if dry_run else []
    status = cli.main(["submit", "--profile", "gke-v6e-16x2", "--target", "kfp", "--host", fake.url, *flags])
    err = capsys.readouterr().err
    assert status == 2, err
    named = [line.split(":", 1)[0].removeprefix("  - ") for line in err.splitlines() if line.startswith("  - ")]
    assert named == PLACEHOLDERS
    assert "'gs://your-bucket/multislice-runs' is the profile's placeholder" in err
    assert "--set output_dir=gs://BUCKET/PATH" in err and "--set cluster_project=PROJECT_ID" in err
    assert "--set trainer_image=REGISTRY/PATH/multislice-trainer@sha256:" in err and "multislice images build" in err
    assert fake.state.requests == []
    # The Python API refuses the same, with the same fields, through the same check.
    call = submission.dry_run if dry_run else multislice.submit
    with pytest.raises(ConfigError) as raised:
        call("gke-v6e-16x2", {"output_dir": "gs://team-bucket/runs"}, target="kfp", kfp=submission.KfpTarget(fake.url))
    assert [f for f, _ in raised.value.issues] == PLACEHOLDERS[1:]
    assert fake.state.requests == []
    # Real-looking values go through to the (fake) endpoint.
    monkeypatch.undo()
    status = cli.main(["submit", "--profile", "gke-v6e-16x2", "--target", "kfp", "--host", fake.url,
                       *deployment.sets(), *flags])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    assert len(fake.state.sent("POST", "/runs")) == (0 if dry_run else 1)


def test_an_unreachable_endpoint_and_missing_credentials_are_refused_before_compiling(tmp_path, monkeypatch):
    """Issue 44: both were reported only after the pipeline's compile (46-158 s on a loaded machine)."""
    from google.cloud.aiplatform import initializer

    from multislice.errors import InputError

    monkeypatch.setattr(submission, "compile_for", _no_compile)
    with pytest.raises(InputError, match="the endpoint did not answer"):
        multislice.submit(PROFILE, VALUES, target="kfp", kfp=submission.KfpTarget(host="http://127.0.0.1:9"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    monkeypatch.setattr(initializer.global_config, "_credentials", None)
    where = submission.VertexTarget(project="team-project", location="us-east5")
    with pytest.raises(InputError, match="no Google Cloud credentials"):
        multislice.submit(PROFILE, VALUES, target="vertex", vertex=where)


def test_a_misspelt_parameter_gets_did_you_mean_and_does_not_hide_a_bad_value():
    with pytest.raises(ConfigError) as raised:
        submission.prepare(config.read_profile(PROFILE), {"stage1_stepz": 5, "num_slices": 0}, "kfp")
    issues = dict(raised.value.issues)
    assert issues["stage1_stepz"].startswith("unknown pipeline parameter; did you mean stage1_steps?")
    assert "num_slices" in issues  # checked too: one bad name does not hide a bad value


def test_a_bad_location_is_refused_without_importing_aiplatform():
    import subprocess
    import sys

    code = (
        "import sys; from multislice.delivery import checks; "
        "assert checks.vertex_location_problem('us-east5') is None; "
        "assert 'not a Vertex AI region' in checks.vertex_location_problem('us-eats5'); "
        "assert 'google.cloud.aiplatform' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
