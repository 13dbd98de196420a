"""Container images a cluster can pull: built by Cloud Build (no Docker engine needed) or ``make images``.

Both images (``containers/pipeline``, ``containers/trainer``) are tagged
``<package version>-<commit>`` (:func:`image_tag`) and pushed to an Artifact
Registry repository, ``REGION-docker.pkg.dev/PROJECT/REPOSITORY``. Each build
writes ``build/images/<image>.json`` with the image's name and digest, in the
keys ``docker buildx build --metadata-file`` writes (``image.name``,
``containerimage.digest``), so ``make images`` and Cloud Build leave the same
file; ``multislice compile`` reads them (:func:`built_references`) and writes
the images into the pipeline by digest (``<repo>/multislice-<image>@sha256:...``).

Cloud Build path (:func:`cloud_build`), as ``gcloud builds submit`` does it: the
repository's tracked files (``git ls-files``) as a gzipped tarball uploaded to
``gs://<project>_cloudbuild/source/``, then one ``CreateBuild`` whose steps run
``docker build`` for each Dockerfile with the repository as context and whose
``images`` Cloud Build pushes after the steps and reports, with digests, in
``results.images``. The long-running operation is polled until the build ends.

Sources: Cloud Build REST v1 ``projects.builds.create`` and ``Build``
(https://cloud.google.com/build/docs/api/reference/rest/v1/projects.builds: ``source.storageSource``,
``steps``, ``images``, ``results.images[].digest``, ``timeout``); google-cloud-build 3.x
``CloudBuildClient.create_build`` (returns a ``google.api_core.operation.Operation``).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import re
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multislice import release
from multislice.errors import InputError, RunFailed

#: The images, each built from ``containers/<image>/Dockerfile`` with the repository root as context.
IMAGES = ("pipeline", "trainer")
#: Where builds write ``<image>.json`` (relative to the repository root), and ``compile`` reads them.
IMAGES_DIR = Path("build", "images")
#: The builder image Cloud Build runs ``docker build`` in.
DOCKER_BUILDER = "gcr.io/cloud-builders/docker"
#: How long a build may take, seconds: the trainer image installs JAX, libtpu and MaxText.
BUILD_TIMEOUT_SECONDS = 3600
#: An Artifact Registry Docker repository: ``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY``.
_REPO = re.compile(r"^[a-z0-9-]+-docker\.pkg\.dev/[a-z][-a-z0-9.:]*[a-z0-9]/[a-z]([-a-z0-9]*[a-z0-9])?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class BuiltImage:
    """One pushed image.

    Attributes:
        image: ``pipeline`` or ``trainer``.
        name: ``<repo>/multislice-<image>:<tag>``.
        digest: ``sha256:<64 hex>``, the manifest digest the registry holds.
    """

    image: str
    name: str
    digest: str

    @property
    def reference(self) -> str:
        """The image by digest: ``<repo>/multislice-<image>@sha256:...`` (what a cluster pulls, immutably)."""
        return f"{self.name.rsplit(':', 1)[0]}@{self.digest}"


def image_name(repo: str, image: str, tag: str) -> str:
    """``<repo>/multislice-<image>:<tag>``."""
    return f"{repo.rstrip('/')}/multislice-{image}:{tag}"


def git_commit(root: str | Path = ".") -> str:
    """The repository's commit (12 hex digits), with ``-dirty`` when tracked files changed; ``nocommit`` without git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "nocommit"
    return f"{commit}-dirty" if dirty else commit


def image_tag(version: str | None = None, commit: str | None = None, root: str | Path = ".") -> str:
    """The images' tag: ``<package version>-<commit>``, e.g. ``0.1.0-3f2a9c1d0b7e`` (Docker tag characters only)."""
    tag = f"{version or release.version()}-{commit or git_commit(root)}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", tag)[:128]


def check_repo(repo: str) -> str:
    """Return ``repo`` if it is an Artifact Registry Docker repository path.

    Raises:
        InputError: not ``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY``.
    """
    if not _REPO.fullmatch(repo.rstrip("/")):
        raise InputError(
            f"--repo {repo!r} is not an Artifact Registry Docker repository",
            "give LOCATION-docker.pkg.dev/PROJECT/REPOSITORY, e.g. us-east5-docker.pkg.dev/my-project/multislice",
        )
    return repo.rstrip("/")


def source_tarball(root: str | Path = ".") -> bytes:
    """The repository's tracked files (``git ls-files``, as in the working tree) as a gzipped tarball.

    Raises:
        InputError: ``root`` is not a git checkout (the source must be exactly the repository's files).
    """
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise InputError(f"{root} is not a git checkout", "run from the repository root (a git clone)") from None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in sorted(n for n in listed.decode().split("\0") if n):
            path = Path(root, name)
            if path.is_file():
                info = tar.gettarinfo(str(path), arcname=name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
    return buffer.getvalue()


def build_request(repo: str, tag: str, bucket: str, source_object: str) -> Any:
    """The ``cloudbuild_v1.Build`` of both images from the uploaded source (built, not sent)."""
    from google.cloud.devtools import cloudbuild_v1
    from google.protobuf import duration_pb2

    steps = [
        cloudbuild_v1.BuildStep(
            name=DOCKER_BUILDER,
            id=f"build-{image}",
            args=["build", "-f", f"containers/{image}/Dockerfile", "-t", image_name(repo, image, tag), "."],
            wait_for=["-"],  # both images build at once
        )
        for image in IMAGES
    ]
    return cloudbuild_v1.Build(
        source=cloudbuild_v1.Source(storage_source=cloudbuild_v1.StorageSource(bucket=bucket, object_=source_object)),
        steps=steps,
        images=[image_name(repo, image, tag) for image in IMAGES],
        timeout=duration_pb2.Duration(seconds=BUILD_TIMEOUT_SECONDS),
        tags=["multislice-pipelines", re.sub(r"[^a-z0-9_.-]", "-", tag.lower())[:128]],
    )


def cloud_build(
    project: str,
    repo: str,
    *,
    root: str | Path = ".",
    tag: str | None = None,
    bucket: str | None = None,
    output_dir: str | Path | None = None,
    client: Any = None,
    storage_client: Any = None,
    credentials: Any = None,
    timeout: float = BUILD_TIMEOUT_SECONDS + 600,
    on_progress: Any = print,
) -> dict[str, BuiltImage]:
    """Build and push both images with Cloud Build; write ``<output_dir>/<image>.json``; no Docker engine needed.

    Args:
        project: Google Cloud project that runs the build (Cloud Build API enabled).
        repo: ``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY`` (Cloud Build's service account may push there).
        root: The repository root (its tracked files are the build context).
        tag: Default :func:`image_tag` (package version and commit).
        bucket: Bucket for the source tarball; default ``<project>_cloudbuild`` (as gcloud).
        output_dir: Where the ``<image>.json`` files go; default ``<root>/build/images``.
        client, storage_client, credentials: A ``CloudBuildClient`` and a ``storage.Client`` (tests pass
            ones pointed at fakes); default ones built on ``credentials`` (None: the environment's).
        timeout: Seconds to wait for the build to end.

    Returns:
        ``{image: BuiltImage}`` with each image's digest.

    Raises:
        InputError: a bad ``repo`` or no git checkout, before anything is sent.
        RunFailed: the build ended other than SUCCESS (with its log URL), or reported no digest.
        google.api_core.exceptions.GoogleAPICallError: the API refused a request.
    """
    repo = check_repo(repo)
    tag = tag or image_tag(root=root)
    source = source_tarball(root)
    if client is None:
        from google.cloud.devtools import cloudbuild_v1

        client = cloudbuild_v1.CloudBuildClient(credentials=credentials)
    if storage_client is None:
        from google.cloud import storage

        storage_client = storage.Client(project=project, credentials=credentials)
    bucket = bucket or f"{project}_cloudbuild"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    source_object = f"source/multislice-{tag}-{stamp}-{hashlib.sha256(source).hexdigest()[:12]}.tgz"
    storage_client.bucket(bucket).blob(source_object).upload_from_string(source, content_type="application/gzip")
    on_progress(f"source: gs://{bucket}/{source_object} ({len(source) / 1e6:.1f} MB)")
    operation = client.create_build(project_id=project, build=build_request(repo, tag, bucket, source_object))
    build_id = getattr(operation.metadata, "build", None) and operation.metadata.build.id
    on_progress(f"Cloud Build {build_id or '?'} building {', '.join(IMAGES)} as {tag}")
    from google.cloud.devtools import cloudbuild_v1

    try:
        build = operation.result(timeout=timeout)
    except Exception as error:  # an operation that ends with an error status raises its GoogleAPICallError
        from google.api_core import exceptions

        if isinstance(error, exceptions.GoogleAPICallError):
            raise RunFailed(
                f"Cloud Build {build_id} failed: {error.message}",
                "read the build's log in the "
                "Cloud console (Cloud Build > History) and fix the Dockerfile or the lock files",
            ) from None
        raise
    if build.status != cloudbuild_v1.Build.Status.SUCCESS:
        raise RunFailed(
            f"Cloud Build {build.id} ended {build.status.name}: {build.status_detail or 'no detail'}",
            f"read its log: {build.log_url or 'Cloud console, Cloud Build > History'}",
        )
    digests = {image.name: image.digest for image in build.results.images}
    built = {}
    for image in IMAGES:
        name = image_name(repo, image, tag)
        digest = digests.get(name, "")
        if not _DIGEST.fullmatch(digest):
            raise RunFailed(f"Cloud Build {build.id} reported no digest for {name}", "check the build's pushed images")
        built[image] = BuiltImage(image, name, digest)
    write_built(
        built, Path(output_dir) if output_dir else Path(root) / IMAGES_DIR, source="cloud-build", build_id=build.id
    )
    for found in built.values():
        on_progress(f"{found.image}: {found.reference}")
    return built


def write_built(built: Mapping[str, BuiltImage], directory: Path, **extra: str) -> list[Path]:
    """Write ``<directory>/<image>.json`` per image in ``docker buildx --metadata-file``'s keys; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for image, found in built.items():
        path = directory / f"{image}.json"
        path.write_text(
            json.dumps(
                {"image.name": found.name, "containerimage.digest": found.digest, **extra}, indent=2, sort_keys=True
            )
            + "\n",
            encoding="utf-8",
        )
        paths.append(path)
    return paths


def built_references(directory: str | Path = IMAGES_DIR) -> dict[str, str]:
    """The images by digest from ``<directory>/<image>.json`` (Cloud Build's or ``docker buildx``'s), by image.

    An image without a file (or with no pushed digest: a ``--load`` build) is left out.

    Raises:
        InputError: a file that is not such JSON.
    """
    found = {}
    for image in IMAGES:
        path = Path(directory, f"{image}.json")
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            name, digest = str(data["image.name"]).split(",")[0], str(data.get("containerimage.digest", ""))
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f"{path} is not an image build's metadata", f"rebuild the images or delete {path}"
            ) from None
        if _DIGEST.fullmatch(digest) and "/" in name:
            found[image] = BuiltImage(image, name, digest).reference
    return found
