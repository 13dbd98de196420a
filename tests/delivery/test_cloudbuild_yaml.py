"""``cloudbuild.yaml``: the images built without Python, the same build as ``multislice images build --cloud-build``.

The file is read as Cloud Build reads it: a ``Build`` (google-cloud-build's message, unknown fields refused),
its user substitutions applied by Cloud Build's rules (``$_KEY`` and ``${_KEY}`` replaced, ``$$`` a literal
``$``: https://cloud.google.com/build/docs/configuring-builds/substitute-variable-values), then compared with
:func:`multislice.delivery.images.build_request`, so the two cannot drift.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.devtools import cloudbuild_v1

from multislice.delivery import images
from tests.cloudbuild_fake import FakeCloudBuild
from tests.conftest import ROOT
from tests.gcs import FakeGcs

CONFIG = ROOT / "cloudbuild.yaml"
PROJECT = "team-project"
REPO = "us-east5-docker.pkg.dev/team-project/multislice"
TAG = "0.1.0-3a64223e3bc3"
#: A user substitution reference: ``$_KEY`` or ``${_KEY}`` (not ``$$``, an escaped ``$``).
_REFERENCE = re.compile(r"(?<!\$)\$(?:\{(_[A-Z0-9_]+)\}|(_[A-Z0-9_]+))")


def config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def substitute(value: Any, values: dict[str, str]) -> Any:
    """``value`` with Cloud Build's substitutions applied to every string in it."""
    if isinstance(value, dict):
        return {key: substitute(item, values) for key, item in value.items()}
    if isinstance(value, list):
        return [substitute(item, values) for item in value]
    if not isinstance(value, str):
        return value
    parts = value.split("$$")
    return "$".join(_REFERENCE.sub(lambda m: values[m.group(1) or m.group(2)], part) for part in parts)


def substituted(repo: str = REPO, tag: str = TAG) -> dict[str, Any]:
    """The build Cloud Build runs for ``--substitutions=_REPO=repo,_TAG=tag``."""
    raw = config()
    return {
        key: value for key, value in substitute(raw, {"_REPO": repo, "_TAG": tag}).items() if key != "substitutions"
    }


def test_it_is_a_cloud_build_config_whose_substitutions_all_match():
    raw = config()
    build = cloudbuild_v1.Build.from_json(json.dumps(raw))  # raises on a field Build does not have
    assert build.timeout.seconds == images.BUILD_TIMEOUT_SECONDS and images.BUILD_TAG in build.tags
    # Cloud Build's default substitution check (MUST_MATCH): every reference declared, every declared one used.
    text = json.dumps(raw["steps"] + raw["images"]).replace("$$", "")
    used = {m.group(1) or m.group(2) for m in _REFERENCE.finditer(text)}
    assert used == set(raw["substitutions"]) == {"_REPO", "_TAG"}
    # A trigger runs as a user-specified service account: its log must stay out of the default logs bucket.
    assert raw["options"]["logging"] in images.LOGGING_WITHOUT_BUCKET


def test_it_builds_what_the_python_path_builds():
    ours = cloudbuild_v1.Build.to_dict(images.build_request(REPO, TAG, "bucket", "source/x.tgz"))
    theirs = cloudbuild_v1.Build.to_dict(cloudbuild_v1.Build.from_json(json.dumps(substituted())))
    docker_builds = [step for step in theirs["steps"] if step["id"].startswith("build-")]

    def what(step: dict[str, Any]) -> tuple[str, str, list[str]]:
        return step["id"], step["name"], step["args"]

    # Same builder, Dockerfiles, build arguments, context and image names, image by image; the same pushes.
    assert [what(step) for step in docker_builds] == [what(step) for step in ours["steps"]]
    assert [step["id"] for step in docker_builds] == [f"build-{image}" for image in images.IMAGES]
    assert theirs["images"] == ours["images"] == [images.image_name(REPO, i, TAG) for i in images.IMAGES]
    assert theirs["timeout"] == ours["timeout"]
    # Both at once, after the check.
    assert all(step["wait_for"] == ["check-substitutions"] for step in docker_builds)


def test_make_images_builds_the_same_dockerfiles_and_names():
    recipe = re.search(r"^images:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.S | re.M).group(0)
    assert re.search(r"for image in (.+?); do", recipe).group(1).split() == list(images.IMAGES)
    assert "-f containers/$$image/Dockerfile -t $(IMAGE_REPO)/multislice-$$image:$(IMAGE_TAG)" in recipe


def run_check(repo: str, tag: str) -> subprocess.CompletedProcess[str]:
    """The check step as Cloud Build runs it: ``bash -c`` with the step's env, substitutions applied."""
    [check] = [step for step in substituted(repo, tag)["steps"] if step["id"] == "check-substitutions"]
    assert check["entrypoint"] == "bash" and check["args"][0] == "-c"
    env = dict(item.split("=", 1) for item in check["env"])
    return subprocess.run(["bash", "-c", check["args"][1]], env=env, capture_output=True, text=True, timeout=30)


def test_the_check_uses_the_python_paths_repository_pattern():
    [check] = [step for step in substituted()["steps"] if step["id"] == "check-substitutions"]
    [pattern] = re.findall(r"^repo_pattern=(.+)$", check["args"][1], re.M)
    assert shlex.split(pattern) == [images._REPO.pattern]  # noqa: SLF001 - the one pattern both paths use


@pytest.mark.parametrize(
    ("repo", "tag", "error"),
    [
        ("", TAG, "error: _REPO '' is not an Artifact Registry Docker repository"),
        ("gcr.io/team-project", TAG, "error: _REPO 'gcr.io/team-project' is not an Artifact Registry"),
        (REPO, "", "error: _TAG '' is not a Docker tag"),
        (REPO, "0.1.0 dirty", "error: _TAG '0.1.0 dirty' is not a Docker tag"),
    ],
)
def test_the_check_refuses_a_missing_or_malformed_substitution(repo, tag, error):
    done = run_check(repo, tag)
    assert done.returncode == 1 and error in done.stderr and "fix: give --substitutions=" in done.stderr


def test_the_check_passes_a_repository_and_tag():
    done = run_check(REPO, TAG)
    assert done.returncode == 0, done.stderr


def test_cloud_build_accepts_it_from_a_trigger_with_a_service_account_and_pushes_both_images(tmp_path: Path):
    """Sent as a trigger sends it (its service account set, the repository's files as source), the fake
    Cloud Build finds both Dockerfiles and pushes both images."""
    bucket = f"{PROJECT}_cloudbuild"
    with FakeGcs(buckets=(bucket,), project=PROJECT) as gcs, FakeCloudBuild(gcs.url) as cloud_build:
        store = storage.Client(
            project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs.url}
        )
        store.bucket(bucket).blob("source/repo.tgz").upload_from_string(images.source_tarball(ROOT))
        build = cloudbuild_v1.Build.from_json(json.dumps(substituted()))
        build.source = cloudbuild_v1.Source(
            storage_source=cloudbuild_v1.StorageSource(bucket=bucket, object_="source/repo.tgz")
        )
        build.service_account = f"projects/{PROJECT}/serviceAccounts/ci@{PROJECT}.iam.gserviceaccount.com"
        done = cloud_build.client().create_build(project_id=PROJECT, build=build).result(timeout=60)
    assert done.status == cloudbuild_v1.Build.Status.SUCCESS, done.status_detail
    assert [image.name for image in done.results.images] == [images.image_name(REPO, i, TAG) for i in images.IMAGES]
