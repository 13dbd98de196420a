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
``gs://<project>_cloudbuild/source/`` (the bucket created when missing, and the
default one refused when another project owns it: :func:`ensure_source_bucket`),
then one ``CreateBuild`` whose steps run ``docker build`` for each Dockerfile with
the repository as context and whose ``images`` Cloud Build pushes after the steps
and reports, with digests, in ``results.images``. The long-running operation is
polled until the build ends. The build may run as a user-specified service
account, with a logging mode and a logs bucket (:func:`check_build_identity`
refuses the combinations Cloud Build refuses, before anything is sent).

``cloudbuild.yaml`` at the repository root is the same build for
``gcloud builds submit --config cloudbuild.yaml`` and for Cloud Build triggers
(no Python needed); ``tests/delivery/test_cloud_build.py`` checks it against
:func:`build_request` (Dockerfiles, builder, arguments, image names, timeout).

Sources: Cloud Build REST v1 ``projects.builds.create`` and ``Build``
(https://cloud.google.com/build/docs/api/reference/rest/v1/projects.builds: ``source.storageSource``,
``steps``, ``images``, ``results.images[].digest``, ``timeout``, ``serviceAccount``, ``logsBucket``,
``options.logging``); google-cloud-build 3.x ``CloudBuildClient.create_build`` (returns a
``google.api_core.operation.Operation``). The source bucket: Google Cloud SDK (gcloud)
``googlecloudsdk/command_lib/builds/staging_bucket_util.py`` ``GetDefaultStagingBucket`` (the name),
``googlecloudsdk/command_lib/builds/submit_util.py`` ``SetSource`` and
``googlecloudsdk/api_lib/storage/storage_api.py`` ``StorageClient.CreateBucketIfNotExists`` (creation and
the ownership check). The service-account rule: Cloud Build docs, "Configure user-specified service
accounts", "Set up build logs"
(https://cloud.google.com/build/docs/securing-builds/configure-user-specified-service-accounts).
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
from multislice.delivery import checks
from multislice.errors import InputError, RunFailed

#: The images, each built from ``containers/<image>/Dockerfile`` with the repository root as context.
IMAGES = ("pipeline", "trainer")
#: Where builds write ``<image>.json`` (relative to the repository root), and ``compile`` reads them.
IMAGES_DIR = Path("build", "images")
#: The builder image Cloud Build runs ``docker build`` in.
DOCKER_BUILDER = "gcr.io/cloud-builders/docker"
#: The Cloud Build tag every build of the images carries (``cloudbuild.yaml`` too).
BUILD_TAG = "multislice-pipelines"
#: How long a build may take, seconds: the trainer image installs JAX, libtpu and MaxText.
BUILD_TIMEOUT_SECONDS = 3600
#: An Artifact Registry Docker repository: ``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY``.
_REPO = re.compile(r"^[a-z0-9-]+-docker\.pkg\.dev/[a-z][-a-z0-9.:]*[a-z0-9]/[a-z]([-a-z0-9]*[a-z0-9])?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
#: ``BuildOptions.logging`` modes a build may ask for (``STACKDRIVER_ONLY`` is deprecated for
#: ``CLOUD_LOGGING_ONLY``; ``LOGGING_UNSPECIFIED`` is Cloud Build's default, which acts as ``LEGACY``).
LOGGING_MODES = ("LEGACY", "GCS_ONLY", "CLOUD_LOGGING_ONLY", "NONE")
#: The logging modes that keep no log in Cloud Build's default logs bucket, so a user-specified service
#: account may run the build without ``logs_bucket`` (Cloud Build docs, "Set up build logs").
LOGGING_WITHOUT_BUCKET = ("CLOUD_LOGGING_ONLY", "NONE")
#: ``Build.serviceAccount``: ``projects/{PROJECT_ID}/serviceAccounts/{ACCOUNT}`` (REST reference, ``Build``).
_SERVICE_ACCOUNT = re.compile(r"^projects/[^/\s]+/serviceAccounts/[^/\s]+$")
_SERVICE_ACCOUNT_EMAIL = re.compile(r"^[a-z0-9][-a-z0-9.]*@([a-z0-9][-a-z0-9.]*)\.gserviceaccount\.com$")
#: ``Build.logsBucket``: ``gs://BUCKET`` or ``gs://BUCKET/PREFIX`` (gcloud's ``--gcs-log-dir`` writes these forms).
_LOGS_BUCKET = re.compile(r"^gs://[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9](/.*)?$")


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
    # gzip's own default level (what ``gzip`` and ``tar czf`` use), not tarfile's 9: measured here
    # (2026-11-27, 2 cores) 1.2 s instead of 3.8 s of CPU for this repository, and 2% larger.
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name in sorted(n for n in listed.decode().split("\0") if n):
            path = Path(root, name)
            if path.is_file():
                info = tar.gettarinfo(str(path), arcname=name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
    return buffer.getvalue()


def default_source_bucket(project: str) -> str:
    """The default source bucket, ``<project>_cloudbuild``, with the project ID made a bucket name as gcloud
    makes it (``:`` and ``.`` of a domain-scoped project become ``_``; ``google``, which no bucket name may
    hold, becomes ``elgoog``): gcloud's ``staging_bucket_util.GetDefaultStagingBucket``."""
    safe = project.replace(":", "_").replace(".", "_").replace("google", "elgoog")
    return f"{safe}_cloudbuild"


def service_account_name(project: str, account: str) -> str:
    """``Build.serviceAccount`` for ``account``: a resource name ``projects/P/serviceAccounts/EMAIL`` as given,
    or an email made one (its own project for ``NAME@P.iam.gserviceaccount.com``, else the build's ``project``).

    Raises:
        InputError: neither form.
    """
    if _SERVICE_ACCOUNT.fullmatch(account):
        return account
    match = _SERVICE_ACCOUNT_EMAIL.fullmatch(account)
    if not match:
        raise InputError(
            f"--service-account {account!r} is not a service account",
            "give its email (NAME@PROJECT.iam.gserviceaccount.com) or "
            "projects/PROJECT/serviceAccounts/NAME@PROJECT.iam.gserviceaccount.com",
        )
    domain = match.group(1)  # "P.iam" for a user-managed account; "developer", "cloudbuild", ... otherwise
    owner = domain.removesuffix(".iam") if domain.endswith(".iam") and domain.count(".") == 1 else project
    return f"projects/{owner}/serviceAccounts/{account}"


def check_build_identity(
    service_account: str | None, logging: str | None, logs_bucket: str | None
) -> tuple[str | None, str | None]:
    """Check the build's service account, logging mode and logs bucket together; returns ``(logging, logs_bucket)``.

    Cloud Build refuses a build whose ``serviceAccount`` is set unless it writes its log to a user-created
    bucket (``logsBucket``) or not to a bucket at all (``options.logging`` ``CLOUD_LOGGING_ONLY`` or
    ``NONE``): "When you specify your own service account for builds, you must store your build logs either
    in Cloud Logging or in a user-created Cloud Storage bucket. You can not store your logs in the default
    logs bucket" (https://cloud.google.com/build/docs/securing-builds/configure-user-specified-service-accounts);
    the API answers ``INVALID_ARGUMENT: if 'build.service_account' is specified, the build must either (a)
    specify 'build.logs_bucket', (b) use the REGIONAL_USER_OWNED_BUCKET ... option, or (c) use either
    CLOUD_LOGGING_ONLY / NONE logging options``. This raises that before anything is uploaded or sent.

    Args:
        service_account: ``Build.serviceAccount`` (None: Cloud Build's default account).
        logging: One of :data:`LOGGING_MODES` (any case), or None for Cloud Build's default.
        logs_bucket: ``gs://BUCKET[/PREFIX]``, or None for Cloud Build's default logs bucket.

    Raises:
        InputError: an unknown logging mode, a malformed logs bucket, or a service account whose log would
            go to the default logs bucket (the fix names both ways out).
    """
    mode = logging.upper() if logging else None
    if mode is not None and mode not in LOGGING_MODES:
        raise InputError(
            f"--logging {logging!r} is not a Cloud Build logging mode", f"give one of {', '.join(LOGGING_MODES)}"
        )
    if logs_bucket is not None and not _LOGS_BUCKET.fullmatch(logs_bucket):
        raise InputError(
            f"--logs-bucket {logs_bucket!r} is not a Cloud Storage location",
            "give gs://BUCKET or gs://BUCKET/PREFIX (a bucket you created; no retention policy on it)",
        )
    if service_account and not logs_bucket and mode not in LOGGING_WITHOUT_BUCKET:
        raise InputError(
            f"--service-account {service_account} needs the build log kept out of Cloud Build's default logs "
            f"bucket, but --logging is {mode or 'unset (LEGACY)'} and no --logs-bucket is given "
            "(Cloud Build refuses such a build)",
            "add --logging CLOUD_LOGGING_ONLY (the account needs roles/logging.logWriter) or --logging NONE, "
            "or --logs-bucket gs://BUCKET (a bucket you created, which the account may write)",
        )
    return mode, logs_bucket


def ensure_source_bucket(
    storage_client: Any,
    project: str,
    bucket: str,
    *,
    check_ownership: bool,
    location: str | None = None,
    on_progress: Any = print,
) -> bool:
    """Make sure the source bucket exists, as ``gcloud builds submit`` does; returns True if it created it.

    gcloud (``StorageClient.CreateBucketIfNotExists``, called from ``submit_util.SetSource``): get the
    bucket; if missing, create it in ``project`` (no location: Cloud Storage's default, the ``US``
    multi-region, as gcloud's global builds do) and stop there; if it exists (or another creator won the
    race), and it is the default ``<project>_cloudbuild`` bucket, list ``project``'s buckets with the name as
    prefix and refuse when it is not among them: anyone can create a bucket of a guessable name in their own
    project and receive the sources (gcloud: "A bucket with name ... already exists and is owned by another
    project. Specify a bucket using --gcs-source-staging-dir"). A bucket the user names is not checked. A
    bucket created here also gets uniform bucket-level access and enforced public access prevention (gcloud
    leaves these to the project's defaults; a source tarball is never public).

    Args:
        storage_client: A ``google.cloud.storage.Client``.
        project: The project that runs the build (and owns the default bucket).
        bucket: The bucket's name.
        check_ownership: Refuse a bucket that is not ``project``'s (True for the default bucket).
        location: Where to create a missing bucket (None: Cloud Storage's default, ``US``).

    Raises:
        InputError: the default bucket belongs to another project, or this account may not read it.
        google.api_core.exceptions.GoogleAPICallError: Cloud Storage refused another request.
    """
    from google.api_core import exceptions

    def not_ours(why: str) -> InputError:
        return InputError(
            f"gs://{bucket} {why}; nothing was uploaded (the source tarball is the whole repository)",
            "give a bucket of your own with --source-bucket (e.g. --source-bucket "
            f"{project}-multislice-build), or delete gs://{bucket} if it is yours",
        )

    try:
        storage_client.get_bucket(bucket)
    except exceptions.NotFound:
        new = storage_client.bucket(bucket)
        new.iam_configuration.uniform_bucket_level_access_enabled = True
        new.iam_configuration.public_access_prevention = "enforced"
        try:
            storage_client.create_bucket(new, project=project, location=location)
        except exceptions.Conflict:  # created since the get: check it as an existing one
            pass
        else:
            on_progress(f"created gs://{bucket} in project {project} ({location or 'US'})")
            return True
    except exceptions.Forbidden:
        if check_ownership:
            raise not_ours(f"exists, but this account may not read it to check that {project} owns it") from None
        raise InputError(
            f"this account may not read gs://{bucket} (--source-bucket)",
            "grant it roles/storage.admin on the bucket, or give another bucket with --source-bucket",
        ) from None
    if check_ownership:
        owned = storage_client.list_buckets(project=project, prefix=bucket)
        if not any(found.name == bucket for found in owned):
            raise not_ours(f"already exists and is owned by another project than {project}")
    return False


def build_request(
    repo: str,
    tag: str,
    bucket: str,
    source_object: str,
    *,
    service_account: str | None = None,
    logging: str | None = None,
    logs_bucket: str | None = None,
) -> Any:
    """The ``cloudbuild_v1.Build`` of both images from the uploaded source (built, not sent).

    ``service_account`` (``projects/P/serviceAccounts/EMAIL``), ``logging`` (a :data:`LOGGING_MODES` name)
    and ``logs_bucket`` (``gs://...``) go to ``Build.service_account``, ``BuildOptions.logging`` and
    ``Build.logs_bucket`` when given (checked by :func:`check_build_identity` first).
    """
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
    build = cloudbuild_v1.Build(
        source=cloudbuild_v1.Source(storage_source=cloudbuild_v1.StorageSource(bucket=bucket, object_=source_object)),
        steps=steps,
        images=[image_name(repo, image, tag) for image in IMAGES],
        timeout=duration_pb2.Duration(seconds=BUILD_TIMEOUT_SECONDS),
        tags=[BUILD_TAG, re.sub(r"[^a-z0-9_.-]", "-", tag.lower())[:128]],
    )
    if service_account:
        build.service_account = service_account
    if logs_bucket:
        build.logs_bucket = logs_bucket
    if logging:
        build.options = cloudbuild_v1.BuildOptions(logging=cloudbuild_v1.BuildOptions.LoggingMode[logging])
    return build


def cloud_build(
    project: str,
    repo: str,
    *,
    root: str | Path = ".",
    tag: str | None = None,
    bucket: str | None = None,
    bucket_location: str | None = None,
    service_account: str | None = None,
    logging: str | None = None,
    logs_bucket: str | None = None,
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
        bucket: Bucket for the source tarball; default :func:`default_source_bucket` (``<project>_cloudbuild``,
            as gcloud). Created when missing (:func:`ensure_source_bucket`); the default one must be ``project``'s.
        bucket_location: Where a missing bucket is created (default: Cloud Storage's, the ``US`` multi-region).
        service_account: The account the build runs as: an email or ``projects/P/serviceAccounts/EMAIL``
            (default: Cloud Build's default service account). Needs ``logging`` ``CLOUD_LOGGING_ONLY``/``NONE``
            or a ``logs_bucket`` (:func:`check_build_identity`).
        logging: ``BuildOptions.logging``: one of :data:`LOGGING_MODES` (default: Cloud Build's, ``LEGACY``).
        logs_bucket: ``Build.logs_bucket``: ``gs://BUCKET[/PREFIX]``, a bucket you created.
        output_dir: Where the ``<image>.json`` files go; default ``<root>/build/images``.
        client, storage_client, credentials: A ``CloudBuildClient`` and a ``storage.Client`` (tests pass
            ones pointed at fakes); default ones built on ``credentials`` (None: the environment's).
        timeout: Seconds to wait for the build to end.

    Returns:
        ``{image: BuiltImage}`` with each image's digest.

    Raises:
        InputError: a bad ``repo``, service account, logging mode or logs bucket, a service account whose log
            would go to the default logs bucket, or no git checkout, before anything is sent; the default
            bucket owned by another project, before the source is uploaded.
        RunFailed: the build ended other than SUCCESS (with its log URL), or reported no digest.
        google.api_core.exceptions.GoogleAPICallError: the API refused a request.
    """
    repo = check_repo(repo)
    account = service_account_name(project, service_account) if service_account else None
    logging, logs_bucket = check_build_identity(account, logging, logs_bucket)
    tag = tag or image_tag(root=root)
    source = source_tarball(root)
    if client is None:
        from google.cloud.devtools import cloudbuild_v1

        client = cloudbuild_v1.CloudBuildClient(credentials=credentials)
    if storage_client is None:
        from google.cloud import storage

        storage_client = storage.Client(project=project, credentials=credentials)
    default_bucket = not bucket
    bucket = bucket or default_source_bucket(project)
    ensure_source_bucket(
        storage_client, project, bucket, check_ownership=default_bucket, location=bucket_location,
        on_progress=on_progress,
    )  # fmt: skip
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    source_object = f"source/multislice-{tag}-{stamp}-{hashlib.sha256(source).hexdigest()[:12]}.tgz"
    storage_client.bucket(bucket).blob(source_object).upload_from_string(source, content_type="application/gzip")
    on_progress(f"source: gs://{bucket}/{source_object} ({len(source) / 1e6:.1f} MB)")
    request = build_request(
        repo, tag, bucket, source_object, service_account=account, logging=logging, logs_bucket=logs_bucket
    )
    operation = client.create_build(project_id=project, build=request)
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


def unpublished_problem(reference: str) -> str | None:
    """Why a cluster could not pull ``reference`` as this project's image; None when it may.

    A reference whose name has no ``/`` (``multislice-pipeline:0.1.0``, the packaged profiles' images) names no
    registry: the container runtime resolves it to Docker Hub's official images (``docker.io/library/NAME``: the
    distribution reference rules, ``github.com/distribution/reference`` ``normalize.go`` ``ParseNormalizedNamed``),
    where no image of this project is, so every pod of the run would fail to pull it. Images ``make images PUSH=1``
    or Cloud Build pushed are ``REGISTRY/.../multislice-<image>`` (by digest: :func:`built_references`).
    """
    return checks.image_registry_problem(reference)


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
