"""Checks of single values a user gives: image references, GCP names, Cloud Storage paths, output
directories, and the expansion syntaxes that must not reach a container.

Each ``*_problem`` function returns why a value is refused (naming the rule and the fix) or ``None``
when it is fine; the models in :mod:`.models` turn a problem into a validation error of their field.
"""

from __future__ import annotations

import ipaddress
import os
import re
import unicodedata
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
#: The shortest timeout or wait a profile or option may set, seconds: the waits become whole-second fields (a pod's
#: ``activeDeadlineSeconds``, which the API server wants at least 1; ``jax.distributed``'s int timeouts), where a
#: fraction of a second would be 0, no wait at all; and no step's API call, poll or compile ends in under a second.
MIN_TIMEOUT_SECONDS = 1.0

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
#: Label keys and values (Kubernetes ``validation.IsQualifiedName`` / ``IsValidLabelValue``,
#: k8s.io/apimachinery/pkg/util/validation/validation.go: ``qualifiedNameFmt``, at most 63 characters).
_LABEL_NAME = re.compile(r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")

#: Local directories that are not storage: the kernel's and devices' pseudo file systems.
FORBIDDEN_LOCAL_ROOTS: tuple[str, ...] = ("/proc", "/sys", "/dev")
#: Unicode's control (Cc: newline, tab, NUL, DEL, C1) and format (Cf: the bidirectional overrides such as U+202E,
#: zero-width spaces and joiners, the BOM, the soft hyphen) characters: never in a name or a path, where they are
#: invisible or reorder what is shown (https://www.unicode.org/reports/tr9/, "Explicit Directional Overrides").
_INVISIBLE_CATEGORIES = ("Cc", "Cf")
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
    return control_problem(value)


def output_dir_problem(value: str) -> str | None:
    """Why ``value`` cannot be the base output directory, or None.

    ``gs://BUCKET[/PREFIX]`` (:func:`gcs_path_problem`), or a local path that is not empty, holds no control or
    format character (:func:`control_problem`), is not under ``/proc``, ``/sys`` or ``/dev``, and whose nearest
    existing part is a directory: not a file, and not a symbolic link that leads nowhere (dangling, or a loop:
    the directory could never be created through it). A relative path is taken against the current directory,
    as :func:`multislice.identity.run_identity` does.
    """
    if not value.strip():
        return f"{value!r} is empty; give a directory path or gs://BUCKET/PATH"
    if value.startswith("gs://"):
        return gcs_path_problem(value)
    if "://" in value:
        return f"{value!r}: only gs:// and local paths are supported; use gs://BUCKET/PATH or a directory"
    if problem := control_problem(value):
        return problem
    path = Path(os.path.abspath(value))
    for root in FORBIDDEN_LOCAL_ROOTS:
        if path == Path(root) or Path(root) in path.parents:
            return f"{value!r} is under {root}, a pseudo file system, not storage; use a directory on disk"
    for part in (path, *path.parents):
        if not os.path.lexists(part):
            continue
        try:
            os.stat(part)  # follows symbolic links: a dangling one raises ENOENT, a loop ELOOP
        except OSError as error:
            return (
                f"{value!r}: {part} is a symbolic link that leads nowhere ({error.strerror}); the directory could "
                "never be created there: remove or fix the link, or give another directory"
            )
        if not part.is_dir():
            what = "an existing file" if part == path else f"under {part}, an existing file"
            return f"{value!r} is {what}, not a directory; give a directory (or a new path)"
        return None
    return None


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label key (``[prefix/]name``), or None.

    ``IsQualifiedName`` (k8s.io/apimachinery/pkg/util/validation/validation.go), which the API server applies to
    label and node selector keys: at most one '/'; a prefix, when there is a '/', that is a non-empty DNS-1123
    subdomain of at most 253 characters; a name of 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends.
    """
    parts = key.split("/")
    if len(parts) > 2:
        return f"label key {key!r} holds more than one '/': a key is [PREFIX/]NAME"
    prefix, name = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    if prefix is not None and (not _DNS1123_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253):
        return f"label key {key!r}: the prefix must be a non-empty DNS-1123 subdomain (lower-case, at most 253 chars)"
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


#: huggingface_hub's repository id (``utils/_validators.py``, ``REPO_ID_REGEX``, huggingface_hub 2.4.0): an optional
#: namespace and a name, each 1-96 of ``[A-Za-z0-9_.-]`` starting and ending with a letter, digit or '_'.
_HUB_REPO_ID = re.compile(
    r"""(\b[\w\-.]{1,96}\b/)?  # optional namespace (username or organization)
    \b[\w\-.]{1,96}\b        # repo_name""",
    flags=re.VERBOSE | re.ASCII,
)


def hub_repo_id_problem(value: str) -> str | None:
    """Why ``value`` is not a Hugging Face Hub repository id (``NAME`` or ``OWNER/NAME``), or None.

    huggingface_hub's ``validate_repo_id`` (``utils/_validators.py``; the pipeline image has no huggingface_hub, so
    its rules are kept here): at most one '/', each part 1-96 letters, digits, '-', '_' or '.', not starting or
    ending with '-' or '.', no '--' or '..', not ending in '.git'.
    """
    shown = value if len(value) <= 100 else value[:97] + "..."
    fix = "give a Hub name, NAME or OWNER/NAME (letters, digits, '-', '_', '.'; e.g. allenai/c4), or a local directory"
    if value.count("/") > 1:
        return f"{shown!r} is not a Hugging Face Hub repository id: more than one '/'; {fix}"
    if not _HUB_REPO_ID.fullmatch(value):
        return (
            f"{shown!r} is not a Hugging Face Hub repository id: at most 96 characters a part, not starting or "
            f"ending with '-' or '.'; {fix}"
        )
    if "--" in value or ".." in value or value.endswith(".git"):
        return f"{shown!r} is not a Hugging Face Hub repository id: no '--' or '..', nor a final '.git'; {fix}"
    return None


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


def invisible_character(value: str) -> str | None:
    """The first Unicode control (Cc) or format (Cf) character of ``value`` (:data:`_INVISIBLE_CATEGORIES`), or
    None."""
    return next((c for c in value if unicodedata.category(c) in _INVISIBLE_CATEGORIES), None)


def control_problem(value: str) -> str | None:
    """Why ``value`` (a name, a path, a value that reaches a container argument) is refused for a control or an
    invisible format character (a newline, a tab, NUL, U+202E RIGHT-TO-LEFT OVERRIDE...), or None."""
    found = invisible_character(value)
    if found is None:
        return None
    name = unicodedata.name(found, "a control character")
    return (
        f"{value[:80]!r} holds U+{ord(found):04X} ({name}), a control or invisible format character (newline, "
        "tab, NUL, a right-to-left override...); remove it"
    )


def option_like_problem(value: str) -> str | None:
    """Why ``value``, which is passed on as a command-line argument or a name a tool takes as one, is refused for
    starting with '-' (a program would read it as an option: ``--help``), or None."""
    if value.startswith("-"):
        return f"{value[:80]!r} starts with '-', so a program given it would read an option, not a name; give the name"
    return None


def run_name_problem(value: str) -> str | None:
    """Why ``value`` is not a run name, or None: a DNS-1035 label (lower-case letters, digits and '-', starting with
    a letter, ending with a letter or digit) of at most 63 characters, since it is the value of the
    ``multislice-pipelines/run-name`` label and starts every JobSet name (:mod:`multislice.names`)."""
    if names.DNS1035_LABEL.fullmatch(value) and len(value) <= names.MAX_LABEL_LENGTH:
        return None
    shown = value if len(value) <= 80 else value[:77] + "..."
    if names.DNS1035_LABEL.fullmatch(value):
        return f"{shown!r} is {len(value)} characters; a run name is at most {names.MAX_LABEL_LENGTH} (a label value)"
    return (
        f"{shown!r} is not a run name: a DNS-1035 label of at most {names.MAX_LABEL_LENGTH} lower-case letters, "
        "digits and '-', starting with a letter and ending with a letter or digit"
    )


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
