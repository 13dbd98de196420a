"""Images without Docker: Cloud Build through google-cloud-build's REST client, against a loopback fake."""

from __future__ import annotations

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
from tests.cloudbuild_fake import FakeCloudBuild
from tests.conftest import ROOT
from tests.gcs import FakeGcs

PROJECT = "team-project"
REPO = "us-east5-docker.pkg.dev/team-project/multislice"


@pytest.fixture
def services():
    with FakeGcs(buckets=(f"{PROJECT}_cloudbuild",)) as gcs, FakeCloudBuild(gcs.url) as cloud_build:
        store = storage.Client(
            project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs.url}
        )
        yield gcs, cloud_build, store


def build(services, tmp_path, **kwargs):
    _, cloud_build, store = services
    return images.cloud_build(
        PROJECT,
        REPO,
        root=ROOT,
        output_dir=tmp_path,
        client=cloud_build.client(),
        storage_client=store,
        on_progress=lambda _: None,
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
            ["compile", "--profile", "gke-v6e-16x2", "--images", str(tmp_path / "images"), "--output", str(output)]
        )
        == 0
    )
    spec, _ = targets.documents(output)
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {
        built["pipeline"].reference
    }
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["trainer_image"]["defaultValue"] == built["trainer"].reference
