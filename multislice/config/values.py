"""Checks of single values a user gives: image references, GCP names, Cloud Storage paths, output
directories, and the expansion syntaxes that must not reach a container.

Each ``*_problem`` function returns why a value is refused (naming the rule and the fix) or ``None``
when it is fine; the models in :mod:`.models` turn a problem into a validation error of their field.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from multislice import names

#: The Kubernetes API's int32 limit: JobSet ``replicas``, ``failurePolicy.maxRestarts``, a
#: WorkloadPriorityClass ``value`` (https://kubernetes.io/docs/reference/using-api/api-concepts/, int32 fields).
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
#: The longest timeout or wait a profile may set, seconds (365 days): waits become pod deadlines
#: (``activeDeadlineSeconds``) and ``jax.distributed`` timeouts (whole seconds, an int32); no run here
#: waits longer, and a larger value (``1e308``) is a typo that would overflow those fields.
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600

# The docker reference grammar (github.com/distribution/reference ``regexp.go``).
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
#: A container image reference: ``[domain[:port]/]path[:tag][@digest]``.
IMAGE_REFERENCE = re.compile(
    rf"(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII
)
#: Longest image name (without tag and digest) the reference grammar allows.
IMAGE_NAME_MAX_LENGTH = 255

#: A Google Cloud project ID: 6-30 characters, lower-case letters, digits and '-', starting with a letter
#: (https://cloud.google.com/resource-manager/docs/creating-managing-projects#before_you_begin).
GCP_PROJECT = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
#: A GKE cluster name: a lower-case letter, then up to 39 lower-case letters, digits or '-', not ending in '-'
#: (``gcloud container clusters create`` NAME).
GKE_CLUSTER = re.compile(r"[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?")
#: A Compute Engine region (``us-east5``) or zone (``us-east5-b``).
GCP_LOCATION = re.compile(r"[a-z]+-[a-z]+[0-9]+(?:-[a-z])?")
#: Characters of a Cloud Storage bucket name (https://cloud.google.com/storage/docs/buckets#naming).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]")
#: Label keys and values (Kubernetes ``validation.IsQualifiedName`` / ``IsValidLabelValue``).
_LABEL_NAME = re.compile(r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")

#: Local directories that are not storage: the kernel's and devices' pseudo file systems.
FORBIDDEN_LOCAL_ROOTS: tuple[str, ...] = ("/proc", "/sys", "/dev")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Syntaxes expanded inside the container: Kubernetes ``$(VAR)`` in args and env values (the kubelet expands
#: it; https://kubernetes.io/docs/tasks/inject-data-application/define-command-argument-container/) and
#: OmegaConf ``${...}`` interpolation in the values MaxText resolves (``maxtext/configs/pyconfig.py``).
_EXPANDED = re.compile(r"\$[({]")


def image_problem(value: str) -> str | None:
    """Why ``value`` is not a container image reference (docker grammar, distribution/reference), or None."""
    match = IMAGE_REFERENCE.fullmatch(value)
    if not match:
        return (
            f"{value!r} is not a container image reference; use [REGISTRY[:PORT]/]PATH[:TAG][@sha256:DIGEST] "
            "with a lower-case path, e.g. us-docker.pkg.dev/my-project/images/maxtext:0.2.5"
        )
    if len(match.group("name")) > IMAGE_NAME_MAX_LENGTH:
        return f"image name of {len(match.group('name'))} characters; at most {IMAGE_NAME_MAX_LENGTH} are allowed"
    return None


def gcp_project_problem(value: str) -> str | None:
    """Why ``value`` is not a Google Cloud project ID, or None."""
    if GCP_PROJECT.fullmatch(value):
        return None
    return (
        f"{value!r} is not a Google Cloud project ID: 6-30 lower-case letters, digits and '-', "
        "starting with a letter and not ending with '-' (e.g. my-project)"
    )


def gke_cluster_problem(value: str) -> str | None:
    """Why ``value`` is not a GKE cluster name, or None."""
    if GKE_CLUSTER.fullmatch(value):
        return None
    return (
        f"{value!r} is not a GKE cluster name: at most 40 lower-case letters, digits and '-', "
        "starting with a letter and not ending with '-'"
    )


def gcp_location_problem(value: str) -> str | None:
    """Why ``value`` is not a Compute Engine region or zone, or None."""
    if GCP_LOCATION.fullmatch(value):
        return None
    return f"{value!r} is not a Google Cloud region or zone; use one like us-east5 or us-east5-b"


def bucket_problem(bucket: str) -> str | None:
    """Why ``bucket`` is not a Cloud Storage bucket name, or None.

    Rules (https://cloud.google.com/storage/docs/buckets#naming): lower-case letters, digits, '-', '_'
    and '.'; starting and ending with a letter or digit; 3-63 characters, or up to 222 with dots, each
    dot-separated part at most 63; not an IP address; not starting with ``goog`` nor containing ``google``.
    """
    fix = "use 3-63 lower-case letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    if not _BUCKET.fullmatch(bucket) or len(bucket) < 3:
        return f"{bucket!r} is not a Cloud Storage bucket name; {fix}"
    parts = bucket.split(".")
    if (len(bucket) > 63 and len(parts) == 1) or len(bucket) > 222 or any(not p or len(p) > 63 for p in parts):
        return f"bucket name {bucket!r}: at most 63 characters (222 with dots, 63 per dot-separated part)"
    try:
        ipaddress.ip_address(bucket)
        return f"bucket name {bucket!r} is an IP address; {fix}"
    except ValueError:
        pass
    if bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
        return f"bucket name {bucket!r}: Cloud Storage refuses names starting with 'goog' or containing 'google'"
    return None


def gcs_path_problem(value: str) -> str | None:
    """Why ``value`` is not ``gs://BUCKET[/PREFIX]`` with a valid bucket and a plain prefix, or None.

    The prefix may not hold ``.`` or ``..`` parts (no traversal), empty parts (``//``) or control characters.
    """
    rest = value.removeprefix("gs://")
    bucket, _, prefix = rest.partition("/")
    if problem := bucket_problem(bucket):
        return problem
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(part in ("", ".", "..") for part in parts):
        return f"{value!r}: the path after the bucket may not hold empty, '.' or '..' parts; use gs://BUCKET/PATH"
    if _CONTROL.search(value):
        return f"{value!r} holds a control character; remove it"
    return None


def output_dir_problem(value: str) -> str | None:
    """Why ``value`` cannot be the base output directory, or None.

    ``gs://BUCKET[/PREFIX]`` (:func:`gcs_path_problem`), or a local path that holds no control character,
    is not under ``/proc``, ``/sys`` or ``/dev`` and is not an existing file. A relative path is taken
    against the current directory, as :func:`multislice.identity.run_identity` does.
    """
    if value.startswith("gs://"):
        return gcs_path_problem(value)
    if "://" in value:
        return f"{value!r}: only gs:// and local paths are supported; use gs://BUCKET/PATH or a directory"
    if _CONTROL.search(value):
        return f"{value!r} holds a control character; give a plain directory path"
    path = Path(os.path.abspath(value))
    for root in FORBIDDEN_LOCAL_ROOTS:
        if path == Path(root) or Path(root) in path.parents:
            return f"{value!r} is under {root}, a pseudo file system, not storage; use a directory on disk"
    try:
        if path.exists() and not path.is_dir():
            return f"{value!r} is an existing file, not a directory; give a directory (or a new path)"
    except OSError as error:
        return f"{value!r} cannot be inspected ({error.strerror}); give a directory path"
    return None


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label key (``[prefix/]name``), or None."""
    prefix, _, name = key.rpartition("/")
    if prefix and (not _DNS1123_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253):
        return f"label key {key!r}: the prefix must be a DNS-1123 subdomain (lower-case, at most 253 characters)"
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return f"label key {key!r}: the name must be 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a Kubernetes label value, or None."""
    if value == "" or (len(value) <= 63 and _LABEL_NAME.fullmatch(value)):
        return None
    return f"label value {value!r}: at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends (or empty)"


def pipeline_run_id_problem(value: str) -> str | None:
    """Why ``value`` is not a pipeline run id, or None: the value of the ``pipeline/runid`` label every workload of
    the run carries (:func:`multislice.render.jobset.run_labels`), so a Kubernetes label value
    (``IsValidLabelValue``: at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends), not empty:
    an empty id would select no pipeline run, or every one."""
    if value and len(value) <= names.MAX_LABEL_LENGTH and _LABEL_NAME.fullmatch(value):
        return None
    shown = value if len(value) <= 80 else value[:77] + "..."
    return (
        f"{shown!r} is not a pipeline run id: a Kubernetes label value of 1 to {names.MAX_LABEL_LENGTH} letters, "
        "digits, '-', '_' or '.', alphanumeric at both ends"
    )


def expansion_issues(data: Any, where: str = "", _seen: set[int] | None = None) -> Iterator[tuple[str, str]]:
    """``(field, message)`` for every string in ``data`` (a profile's content) that the container would expand.

    Kubernetes expands ``$(VAR)`` in container args and env values, and OmegaConf ``${...}`` in the values
    MaxText resolves, so a value holding either would change meaning on the way; such values are refused
    (``$$`` is Kubernetes' escape for a literal ``$``, but refusing is clearer than escaping).
    A container reached twice (a YAML alias) is walked once.
    """
    seen = set() if _seen is None else _seen
    if isinstance(data, (Mapping, list, tuple)):
        if id(data) in seen:
            return
        seen.add(id(data))
    if isinstance(data, Mapping):
        for key, value in data.items():
            field = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and _EXPANDED.search(key):
                yield field, _expansion_message(key)
            yield from expansion_issues(value, field, seen)
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            yield from expansion_issues(value, f"{where}[{index}]", seen)
    elif isinstance(data, str) and _EXPANDED.search(data):
        yield where, _expansion_message(data)


def _expansion_message(value: str) -> str:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return (
        f"{shown!r} holds '$(' or '${{', which Kubernetes ($(VAR) in container args) or MaxText's OmegaConf "
        "(${...}) would expand in the container; remove the '$' expression and give the literal value"
    )


def control_problem(value: str) -> str | None:
    """Why ``value`` (a value that reaches a container argument) is refused for a control character, or None."""
    if _CONTROL.search(value):
        return f"{value!r} holds a control character (newline, tab, NUL...); remove it"
    return None


#: A Secret Manager secret version's resource name (https://cloud.google.com/secret-manager/docs/reference/rest/v1/
#: projects.secrets.versions: ``projects/<project>/secrets/<secret>/versions/<version or latest>``).
SECRET_VERSION = re.compile(r"projects/[a-z0-9-]+/secrets/[A-Za-z0-9_-]+/versions/([0-9]+|latest)")


def secret_version_problem(value: str, looks_secret: bool, kind: str, empty_means: str) -> str | None:
    """Why ``value`` is neither '' nor a Secret Manager secret version, or None. When ``looks_secret`` (the value
    looks like the secret itself, ``kind``: a token, a URL), the value is not echoed."""
    if not value or SECRET_VERSION.fullmatch(value):
        return None
    given = f"{kind} (a secret: store it in Secret Manager)" if looks_secret else repr(value[:80])
    return (
        f"{given} is not a Secret Manager secret version: give "
        f"projects/<project>/secrets/<secret>/versions/<version or latest>, or '' for {empty_means}"
    )


def kubernetes_secret_problem(value: str) -> str | None:
    """Why ``value`` is neither '' nor a Kubernetes Secret's name (a DNS-1123 subdomain of at most 253 characters),
    or None. A value shaped like a Hugging Face token (``hf_...``) is not echoed."""
    if not value or (names.DNS1123_SUBDOMAIN.fullmatch(value) and len(value) <= 253):
        return None
    given = "a token" if value.startswith("hf_") else repr(value[:80])
    return f"{given} is not a Kubernetes Secret name (a DNS-1123 subdomain); give the Secret's name, never the token"
