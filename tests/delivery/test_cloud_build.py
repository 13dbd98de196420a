"""Images without Docker: Cloud Build through google-cloud-build's REST client, against a loopback fake."""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from multislice import release
from multislice.delivery import images
from multislice.errors import InputError, RunFailed
from tests.cloudbuild_fake import FakeCloudBuild, enum_name
from tests.conftest import ROOT
from tests.gcs import FakeGcs

PROJECT = "team-project"
REPO = "us-east5-docker.pkg.dev/team-project/multislice"


BUCKET = f"{PROJECT}_cloudbuild"
ACCOUNT = f"builder@{PROJECT}.iam.gserviceaccount.com"


@contextlib.contextmanager
def running(buckets=(BUCKET,), owned_by=None):
    """The Cloud Storage emulator with ``buckets`` in PROJECT (``owned_by``: bucket -> another project), the
    Cloud Build fake reading it, and a storage client of PROJECT pointed at it."""
    with FakeGcs(buckets=buckets, project=PROJECT, owned_by=owned_by) as gcs, FakeCloudBuild(gcs.url) as cloud_build:
        store = storage.Client(
            project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs.url}
        )
        yield gcs, cloud_build, store


@pytest.fixture
def services():
    with running() as started:
        yield started


class Untouchable:
    """A storage client no code may use: any attribute is an error (so a test sees that nothing was asked)."""

    def __getattr__(self, name):
        raise AssertionError(f"Cloud Storage used before the input was checked: {name}")


def build(services, tmp_path, progress=None, **kwargs):
    _, cloud_build, store = services
    return images.cloud_build(
        PROJECT,
        REPO,
        root=ROOT,
        output_dir=tmp_path,
        client=cloud_build.client(),
        storage_client=store,
        on_progress=(progress.append if progress is not None else lambda _: None),
        **kwargs,
    )


def test_cloud_build_pushes_both_images_and_writes_references_by_digest(services, tmp_path):
    gcs, cloud_build, _ = services
    built = build(services, tmp_path)
    tag = images.image_tag(root=ROOT)
    assert tag.startswith(f"{release.version()}-") and re.fullmatch(r"[\w.-]+-[0-9a-f]{12}(-dirty)?", tag)
    for image in images.IMAGES:
        assert built[image].name == f"{REPO}/multislice-{image}:{tag}"
        assert re.fullmatch(rf"{re.escape(REPO)}/multislice-{image}@sha256:[0-9a-f]{{64}}", built[image].reference)
    assert built["pipeline"].digest != built["trainer"].digest
    # The request as the real client sent it: the uploaded source, one docker build per Dockerfile, both images.
    [(method, path, body)] = [r for r in cloud_build.requests if r[0] == "POST"]
    assert path == f"/v1/projects/{PROJECT}/builds"
    source = body["source"]["storageSource"]
    assert source["bucket"] == f"{PROJECT}_cloudbuild" and source["object"].startswith(f"source/multislice-{tag}-")
    assert [s["args"][:3] for s in body["steps"]] == [
        ["build", "-f", f"containers/{i}/Dockerfile"] for i in images.IMAGES
    ]
    assert all(s["name"] == images.DOCKER_BUILDER and s["args"][-1] == "." for s in body["steps"])
    assert body["images"] == [built[i].name for i in images.IMAGES] and body["timeout"] == "3600s"
    # No service account, logging mode or logs bucket unless asked for: Cloud Build's defaults.
    assert not {"serviceAccount", "logsBucket", "options"} & body.keys()
    # The source is the repository's tracked files, Dockerfiles and lock files included; no .venvs, no build/.
    [name] = gcs.names(f"{PROJECT}_cloudbuild", "source/")
    # Written back as docker buildx's metadata keys, which compile reads.
    for image in images.IMAGES:
        data = json.loads((tmp_path / f"{image}.json").read_text())
        assert data["image.name"] == built[image].name and data["containerimage.digest"] == built[image].digest
        assert data["source"] == "cloud-build"
    assert images.built_references(tmp_path) == {i: built[i].reference for i in images.IMAGES}


def test_source_tarball_holds_the_tracked_files_only():
    with tarfile.open(fileobj=io.BytesIO(images.source_tarball(ROOT)), mode="r:gz") as tar:
        names = set(tar.getnames())
    assert {
        "containers/pipeline/Dockerfile",
        "containers/trainer/Dockerfile",
        "pyproject.toml",
        "requirements/pipeline.txt",
        "requirements/trainer.txt",
        "multislice/__init__.py",
    } <= names
    assert not any(n.startswith((".venvs", "build/", ".git/")) for n in names)


def test_a_failed_build_names_its_log_and_writes_nothing(services, tmp_path):
    services[1].fail_builds = "Build step failure: build step 1 exited with 1"
    with pytest.raises(RunFailed) as raised:
        build(services, tmp_path)
    assert "ended FAILURE: Build step failure" in raised.value.message
    assert "cloud-build/builds/" in raised.value.fix
    assert list(tmp_path.iterdir()) == []


def test_a_bad_repository_is_refused_before_any_request(services, tmp_path):
    with pytest.raises(InputError) as raised:
        images.cloud_build(
            PROJECT,
            "gcr.io/team-project",
            root=ROOT,
            client=services[1].client(),
            storage_client=services[2],
            output_dir=tmp_path,
        )
    assert "LOCATION-docker.pkg.dev/PROJECT/REPOSITORY" in raised.value.fix
    assert services[1].requests == []


def test_compile_writes_the_built_images_by_digest(services, tmp_path):
    from multislice import cli
    from multislice.delivery import targets

    built = build(services, tmp_path / "images")
    output = tmp_path / "p.yaml"
    assert (
        cli.main(
            ["compile", "--profile", "gke-v6e-16x2-seed", "--images", str(tmp_path / "images"), "--output", str(output)]
        )
        == 0
    )
    spec, _ = targets.documents(output)
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {
        built["pipeline"].reference
    }
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["trainer_image"]["defaultValue"] == built["trainer"].reference


# -- the source bucket, as gcloud builds submit treats gs://<project>_cloudbuild --------------------------------


def test_the_default_bucket_is_created_in_the_project_when_missing(tmp_path):
    progress = []
    with running(buckets=()) as started:
        gcs = started[0]
        assert gcs.bucket(BUCKET) is None
        build(started, tmp_path, progress)
        created = gcs.bucket(BUCKET)
        assert created is not None and created["project"] == PROJECT
        # gcloud gives no location for a global build's bucket: Cloud Storage's default, the US multi-region.
        assert created["location"] == "US"
        # Private: uniform bucket-level access, public access prevented.
        assert created["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"] is True
        assert created["iamConfiguration"]["publicAccessPrevention"] == "enforced"
        [source] = gcs.names(BUCKET, "source/")
        assert started[1].builds[next(iter(started[1].builds))]["source"]["storageSource"]["object"] == source
    assert f"created gs://{BUCKET} in project {PROJECT} (US)" in progress


def test_a_missing_bucket_is_created_where_asked(tmp_path):
    with running(buckets=()) as started:
        build(started, tmp_path, bucket_location="us-east5")
        assert started[0].bucket(BUCKET)["location"] == "US-EAST5"


def test_an_existing_bucket_of_the_project_is_used_not_created(services, tmp_path):
    gcs, _, store = services
    before = gcs.bucket(BUCKET)
    progress = []
    build(services, tmp_path, progress)
    assert not any(line.startswith("created") for line in progress)
    assert gcs.bucket(BUCKET) == before  # the emulator's own bucket, untouched (location, IAM configuration)
    created = images.ensure_source_bucket(store, PROJECT, BUCKET, check_ownership=True, on_progress=progress.append)
    assert created is False


def test_a_default_bucket_owned_by_another_project_is_refused_before_the_upload(tmp_path):
    """gcloud: "A bucket with name ... already exists and is owned by another project" (b/33046325): whoever
    owns a bucket of that guessable name would receive the repository."""
    with running(buckets=(), owned_by={BUCKET: "squatter-project"}) as (gcs, cloud_build, store):
        with pytest.raises(InputError) as raised:
            build((gcs, cloud_build, store), tmp_path)
        assert gcs.names(BUCKET) == [] and cloud_build.requests == []
        assert gcs.bucket(BUCKET)["project"] == "squatter-project"
    assert f"gs://{BUCKET} already exists and is owned by another project than {PROJECT}" in raised.value.message
    assert "nothing was uploaded" in raised.value.message
    assert "--source-bucket" in raised.value.fix
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_the_user_names_is_created_if_missing_and_not_checked_for_its_owner(tmp_path):
    # As gcloud's --gcs-source-staging-dir: the user chose it; only the guessable default is checked.
    with running(buckets=(), owned_by={"shared-builds": "platform-project"}) as started:
        build(started, tmp_path, bucket="shared-builds")
        assert len(started[0].names("shared-builds", "source/")) == 1
        build(started, tmp_path, bucket="new-builds")
        assert started[0].bucket("new-builds")["project"] == PROJECT


def test_the_default_bucket_name_is_gclouds():
    assert images.default_source_bucket("team-project") == "team-project_cloudbuild"
    # A domain-scoped project; "google" may not appear in a bucket name.
    assert images.default_source_bucket("example.com:googlers") == "example_com_elgoogrs_cloudbuild"


# -- the build's service account and logging ----------------------------------------------------------------------


INFRA = "projects/infra/serviceAccounts/ci@infra.iam.gserviceaccount.com"


@pytest.mark.parametrize(
    ("kwargs", "sent"),
    [
        (
            {"service_account": ACCOUNT, "logging": "CLOUD_LOGGING_ONLY"},
            {
                "serviceAccount": f"projects/{PROJECT}/serviceAccounts/{ACCOUNT}",
                "options": {"logging": "CLOUD_LOGGING_ONLY"},
            },
        ),
        ({"service_account": INFRA, "logging": "none"}, {"serviceAccount": INFRA, "options": {"logging": "NONE"}}),
        (
            {"service_account": "ci@infra.iam.gserviceaccount.com", "logs_bucket": "gs://team-build-logs/images"},
            {"serviceAccount": INFRA, "logsBucket": "gs://team-build-logs/images"},
        ),
        (
            {"logging": "GCS_ONLY", "logs_bucket": "gs://team-build-logs"},
            {"options": {"logging": "GCS_ONLY"}, "logsBucket": "gs://team-build-logs"},
        ),
    ],
)
def test_the_service_account_and_logging_reach_the_request(services, tmp_path, kwargs, sent):
    build(services, tmp_path, **kwargs)
    [(_, _, body)] = [r for r in services[1].requests if r[0] == "POST"]
    if "options" in body:  # the REST client sends enums as numbers
        body["options"]["logging"] = enum_name("LoggingMode", body["options"]["logging"])
    assert {key: body[key] for key in ("serviceAccount", "options", "logsBucket") if key in body} == sent


@pytest.mark.parametrize("logging", [None, "LEGACY", "GCS_ONLY"])
def test_a_service_account_logging_to_the_default_bucket_is_refused_before_any_request(services, tmp_path, logging):
    with pytest.raises(InputError) as raised:
        images.cloud_build(
            PROJECT, REPO, root=ROOT, output_dir=tmp_path, client=services[1].client(), storage_client=Untouchable(),
            service_account=ACCOUNT, logging=logging,
        )  # fmt: skip
    assert services[1].requests == [] and services[0].names(BUCKET) == []
    assert f"--service-account projects/{PROJECT}/serviceAccounts/{ACCOUNT}" in raised.value.message
    assert "Cloud Build refuses such a build" in raised.value.message
    assert "--logging CLOUD_LOGGING_ONLY" in raised.value.fix and "--logs-bucket gs://BUCKET" in raised.value.fix


def test_the_fake_refuses_that_build_as_cloud_build_does(services):
    """The check above stands for Cloud Build's own refusal: sent anyway, the build is refused."""
    from google.api_core import exceptions

    request = images.build_request(
        REPO, "0.1.0-abc", BUCKET, "source/x.tgz", service_account=f"projects/{PROJECT}/serviceAccounts/{ACCOUNT}"
    )
    with pytest.raises(exceptions.BadRequest) as raised:  # 400 INVALID_ARGUMENT over REST
        services[1].client().create_build(project_id=PROJECT, build=request)
    assert "if 'build.service_account' is specified, the build must either (a) specify 'build.logs_bucket'" in str(
        raised.value
    )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"service_account": "builder"}, "--service-account 'builder' is not a service account"),
        ({"logging": "STACKDRIVER"}, "--logging 'STACKDRIVER' is not a Cloud Build logging mode"),
        ({"logs_bucket": "team-build-logs"}, "--logs-bucket 'team-build-logs' is not a Cloud Storage location"),
    ],
)
def test_bad_build_options_are_refused_before_any_request(services, tmp_path, kwargs, named):
    with pytest.raises(InputError) as raised:
        images.cloud_build(
            PROJECT, REPO, root=ROOT, output_dir=tmp_path, client=services[1].client(), storage_client=Untouchable(),
            **kwargs,
        )  # fmt: skip
    assert named in raised.value.message and services[1].requests == []


def test_a_service_account_email_names_its_own_project():
    assert images.service_account_name("team-project", "ci@infra.iam.gserviceaccount.com") == (
        "projects/infra/serviceAccounts/ci@infra.iam.gserviceaccount.com"
    )
    # Google-managed accounts (the Compute Engine default, Cloud Build's legacy one): the build's project.
    compute = "123456789-compute@developer.gserviceaccount.com"
    assert images.service_account_name("team-project", compute) == f"projects/team-project/serviceAccounts/{compute}"


def test_the_cli_refuses_the_combination_with_error_and_fix(capsys):
    from multislice import cli

    status = cli.main(
        ["images", "build", "--cloud-build", "--project", PROJECT, "--repo", REPO, "--service-account", ACCOUNT]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: --service-account") and "fix: add --logging CLOUD_LOGGING_ONLY" in err
    assert "Traceback" not in err


def test_the_cli_passes_the_build_options_on(monkeypatch, tmp_path):
    from multislice import cli

    seen = {}

    def cloud_build(project, repo, **kwargs):
        seen.update(project=project, repo=repo, **kwargs)
        return {}

    monkeypatch.setattr(images, "cloud_build", cloud_build)
    cli.main(
        ["images", "build", "--cloud-build", "--project", PROJECT, "--repo", REPO, "--service-account", ACCOUNT,
         "--logging", "cloud_logging_only", "--logs-bucket", "gs://logs", "--source-bucket", "src",
         "--source-bucket-location", "us-east5", "--output", str(tmp_path)]
    )  # fmt: skip
    assert seen == {
        "project": PROJECT, "repo": REPO, "tag": None, "bucket": "src", "bucket_location": "us-east5",
        "service_account": ACCOUNT, "logging": "CLOUD_LOGGING_ONLY", "logs_bucket": "gs://logs",
        "output_dir": str(tmp_path),
    }  # fmt: skip


def test_a_default_bucket_this_account_may_not_read_is_refused(services, monkeypatch, tmp_path):
    """The real service answers 403 to a get of another project's bucket (the emulator has no IAM: the get is
    made to answer as the service would)."""
    from google.api_core import exceptions

    gcs, _, store = services

    def forbidden(name, *args, **kwargs):
        raise exceptions.Forbidden(f"GET https://storage.googleapis.com/storage/v1/b/{name}: no storage.buckets.get")

    monkeypatch.setattr(store, "get_bucket", forbidden)
    with pytest.raises(InputError) as raised:
        build(services, tmp_path)
    assert f"gs://{BUCKET} exists, but this account may not read it to check that {PROJECT} owns it" in str(
        raised.value
    )
    assert gcs.names(BUCKET) == [] and services[1].requests == []
    with pytest.raises(InputError, match="this account may not read gs://shared-builds"):
        build(services, tmp_path, bucket="shared-builds")
