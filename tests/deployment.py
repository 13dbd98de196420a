"""A deployment's own values in place of the packaged GKE profiles' placeholders, as a user gives them.

``multislice submit`` and ``multislice schedule create`` refuse the profiles' ``gs://your-bucket/...``,
``your-project``, ``your-cluster`` and unbuilt images (:func:`multislice.delivery.checks.placeholder_issues`), so the
tests of what they send use a profile with these values in their place: :func:`profile_file` writes it once per test
session (a path, for ``--profile`` and the Python API alike); :data:`VALUES` are the same values as ``--set`` pairs.
"""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import yaml

from multislice import config

REGISTRY = "us-east5-docker.pkg.dev/team-project/multislice"
TRAINER_IMAGE = f"{REGISTRY}/multislice-trainer:0.1.0-test"
PIPELINE_IMAGE = f"{REGISTRY}/multislice-pipeline:0.1.0-test"
#: What replaces each placeholder: pipeline parameters, and the fields submit compiles in.
VALUES = {
    "output_dir": "gs://team-bucket/runs",
    "cluster_project": "team-project",
    "cluster_name": "team-cluster",
    "trainer_image": TRAINER_IMAGE,
    "images.pipeline": PIPELINE_IMAGE,
    "service_accounts.trainer_gcp_service_account": "multislice-trainer@team-project.iam.gserviceaccount.com",
}


@functools.cache
def profile_file(name: str) -> str:
    """The packaged profile ``name`` with :data:`VALUES` in place of its placeholders, as a ``.yaml`` path."""
    data = config.apply_overrides(config.read_profile(name), VALUES)
    folder = tempfile.mkdtemp(prefix="deployment-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return str(path)


def sets(**changes: str) -> list[str]:
    """:data:`VALUES` (with ``changes``) as ``--set KEY=VALUE`` arguments."""
    return [arg for key, value in {**VALUES, **changes}.items() for arg in ("--set", f"{key}={value}")]
