"""Checks of the values ``multislice submit`` and ``multislice schedule`` send to Vertex AI or KFP.

Every value is checked here before any client is built (``kfp.Client``,
``aiplatform``, a google-cloud client), so a bad one is refused with the field
and the fix instead of a request that times out or that the service refuses
after the pipeline was uploaded. Each ``*_problem`` function returns why a value
is refused, or None.

Rules and their sources:

* **Vertex AI location**: one of :func:`vertex_locations`, google-cloud-aiplatform's own table of
  Vertex AI regions (``google/cloud/aiplatform/constants/base.py``, ``SUPPORTED_REGIONS``, which
  ``aiplatform.utils.validate_region`` checks; the regions of
  https://cloud.google.com/vertex-ai/docs/general/locations), without ``global``: pipeline runs
  and schedules are regional resources (``projects/P/locations/REGION/pipelineJobs``).
* **Google Cloud project ID**: :func:`multislice.config.values.gcp_project_problem` (6-30
  characters, lower-case letters, digits and '-', starting with a letter, not ending with '-').
* **Service account**: on Vertex AI a Google service account's email: a user-managed one,
  ``ACCOUNT@PROJECT.iam.gserviceaccount.com`` with ACCOUNT 6-30 lower-case letters, digits and
  '-' starting with a letter (https://cloud.google.com/iam/docs/service-accounts-create,
  "account ID"), or one of the default service accounts
  (https://cloud.google.com/iam/docs/service-account-types#default):
  ``PROJECT_NUMBER-compute@developer.gserviceaccount.com`` (Compute Engine) or
  ``PROJECT@appspot.gserviceaccount.com`` (App Engine). On KFP the run's pods' Kubernetes
  ServiceAccount (KFP's ``service_account`` becomes the Argo Workflow's
  ``serviceAccountName``): a DNS-1123 subdomain of at most 253 characters, the API server's rule for
  ServiceAccount names (``ValidateServiceAccountName`` = ``NameIsDNSSubdomain``).
* **KFP namespace** (a Kubeflow profile's namespace): a DNS-1123 label of at most 63 characters.
* **KFP host** (``--host`` or ``$KF_PIPELINES_ENDPOINT``, which ``kfp.Client`` reads when no host
  is given): an ``http://`` or ``https://`` URL with a host name and a valid port, nothing else
  (``kfp.Client`` would take ``file://`` and wait for a connection that never comes).
* **Schedule display name**: 1-128 characters, no control characters (the Vertex AI Schedule's
  ``displayName``: "up to 128 characters", REST reference ``projects.locations.schedules``; KFP
  keeps any display name and derives the ScheduledWorkflow's name from it,
  ``toSWFCRDResourceGeneratedName``; the same bound is kept there).
* **Counts**: ``max_concurrent_runs`` 1-10 on KFP (its API server refuses others:
  ``backend/src/apiserver/server/job_server.go``, "The max concurrency of the recurring run is
  out of range. Support 1-10"); on Vertex AI at most :data:`MAX_VERTEX_CONCURRENT_RUNS`
  (``max_concurrent_run_count`` is an int64 with no documented maximum: every concurrent run of a
  schedule trains on its own slices, and a thousand at once is a typo). ``max_runs`` and the
  interval are int64 fields: at most 2^63-1.
* **Cron**: :func:`cron_problem`: an expression that never fires (day 30 or 31 of February, day 31
  of a 30-day month, with day-of-week ``*``) is refused, found with croniter's own search for the
  next fire time (``CroniterBadDateError`` when there is none within 50 years), and so is one whose
  first fire time is after ``end_time``.
"""

from __future__ import annotations

import ast
import datetime
import functools
import importlib.util
import os
import re
import urllib.parse
import zoneinfo
from pathlib import Path
from typing import Any

from multislice import names
from multislice.config import values

#: Longest display name of a schedule (Vertex AI Schedule ``displayName``: up to 128 characters).
MAX_DISPLAY_NAME = 128
#: KFP's API server refuses ``max_concurrency`` outside 1-10 (``job_server.go``, ``validateCreateRecurringRunRequest``).
MAX_KFP_CONCURRENT_RUNS = 10
#: Our bound on Vertex AI ``max_concurrent_run_count`` (an int64 without a documented maximum).
MAX_VERTEX_CONCURRENT_RUNS = 1000
#: int64 fields: Vertex ``max_run_count``, KFP ``interval_second``.
INT64_MAX = 2**63 - 1
#: ``kfp.Client`` reads the endpoint from this variable when no host is given (kfp 2.17 ``client.py``).
KFP_ENDPOINT_ENV = "KF_PIPELINES_ENDPOINT"

_SERVICE_ACCOUNT_ID = r"[a-z](?:[-a-z0-9]{4,28}[a-z0-9])"
#: A user-managed Google service account: ``ACCOUNT@PROJECT.iam.gserviceaccount.com`` (a project
#: of an organisation's domain, ``example.com:p``, gives ``p.example.com`` there).
_USER_MANAGED_SA = re.compile(rf"{_SERVICE_ACCOUNT_ID}@[a-z][-a-z0-9.]{{4,120}}[a-z0-9]\.iam\.gserviceaccount\.com")
_COMPUTE_DEFAULT_SA = re.compile(r"[0-9]{1,20}-compute@developer\.gserviceaccount\.com")
_APP_ENGINE_DEFAULT_SA = re.compile(r"[a-z][-a-z0-9]{4,28}[a-z0-9]@appspot\.gserviceaccount\.com")
#: A Vertex AI network: ``projects/<project number>/global/networks/<network name>``.
_VERTEX_NETWORK = re.compile(r"projects/[0-9]{1,20}/global/networks/[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")


@functools.cache
def vertex_locations() -> frozenset[str]:
    """The locations Vertex AI Pipelines runs and schedules may be created in: the one table of them is
    aiplatform's ``SUPPORTED_REGIONS`` less ``global`` (see the module doc).

    Read from ``google/cloud/aiplatform/constants/base.py``'s source (its ``SUPPORTED_REGIONS = frozenset({...})``
    literal), not imported: importing it imports the whole aiplatform package (3 s of CPU on an idle machine), and a
    bad ``--location`` is refused before anything heavy is loaded. Falls back to the import if the literal moves.
    """
    spec = importlib.util.find_spec("google.cloud.aiplatform")  # finds the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse(Path(folder, "constants", "base.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "SUPPORTED_REGIONS" for t in node.targets)
                and isinstance(node.value, ast.Call)
                and len(node.value.args) == 1
            ):
                try:
                    return frozenset(ast.literal_eval(node.value.args[0])) - {"global"}
                except ValueError:
                    break
    from google.cloud.aiplatform.constants import base

    return frozenset(base.SUPPORTED_REGIONS) - {"global"}


def vertex_location_problem(value: Any) -> str | None:
    """Why ``value`` is not a Vertex AI region a pipeline run can be created in, or None."""
    known = vertex_locations()
    if isinstance(value, str) and value in known:
        return None
    close = sorted(r for r in known if isinstance(value, str) and value[:4] and r.startswith(value[:4]))
    hint = f" (close: {', '.join(close[:6])})" if close else ""
    return (
        f"{value!r} is not a Vertex AI region{hint}; use one of {', '.join(sorted(known))} "
        "(https://cloud.google.com/vertex-ai/docs/general/locations)"
    )


def project_problem(value: Any) -> str | None:
    """Why ``value`` is not a Google Cloud project ID, or None."""
    if not isinstance(value, str):
        return f"{value!r} is not a Google Cloud project ID (a string such as my-project)"
    return values.gcp_project_problem(value)


def gcp_service_account_problem(value: Any) -> str | None:
    """Why ``value`` is not a Google service account's email (Vertex AI ``service_account``), or None."""
    if isinstance(value, str) and any(
        p.fullmatch(value) for p in (_USER_MANAGED_SA, _COMPUTE_DEFAULT_SA, _APP_ENGINE_DEFAULT_SA)
    ):
        return None
    return (
        f"{value!r} is not a Google service account email; give ACCOUNT@PROJECT.iam.gserviceaccount.com "
        "(ACCOUNT: 6-30 lower-case letters, digits and '-', starting with a letter), or a default one "
        "(PROJECT_NUMBER-compute@developer.gserviceaccount.com), or leave it out for Vertex AI's default"
    )


def kubernetes_service_account_problem(value: Any) -> str | None:
    """Why ``value`` is not a Kubernetes ServiceAccount name (KFP ``service_account``), or None."""
    if isinstance(value, str) and len(value) <= 253 and names.DNS1123_SUBDOMAIN.fullmatch(value):
        return None
    return (
        f"{value!r} is not a Kubernetes ServiceAccount name: lower-case letters, digits, '-' and '.', "
        "alphanumeric at both ends, at most 253 characters (e.g. pipeline-runner)"
    )


def kfp_namespace_problem(value: Any) -> str | None:
    """Why ``value`` is not a Kubernetes namespace (a Kubeflow profile's), or None."""
    if isinstance(value, str) and len(value) <= names.MAX_LABEL_LENGTH and names.DNS1123_LABEL.fullmatch(value):
        return None
    return (
        f"{value!r} is not a namespace name (DNS-1123 label: at most 63 lower-case letters, digits and '-', "
        "alphanumeric at both ends), e.g. kubeflow-user-example-com"
    )


def host_problem(value: Any) -> str | None:
    """Why ``value`` is not an ``http(s)://HOST[:PORT][/PATH]`` URL of a KFP endpoint, or None."""
    fix = "give the KFP API endpoint as http://HOST[:PORT] or https://HOST, e.g. http://localhost:8888"
    if not isinstance(value, str) or not value:
        return f"{value!r} is not a URL; {fix}"
    if problem := values.control_problem(value):
        return f"{problem}; {fix}"
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError as error:
        return f"{value!r} is not a URL ({error}); {fix}"
    if parts.scheme not in ("http", "https"):
        return f"{value!r}: only http:// and https:// endpoints are accepted, not {parts.scheme or 'no'} scheme; {fix}"
    if not parts.hostname or " " in value or port == 0:
        return f"{value!r} has no host name (or a bad port); {fix}"
    return None


def display_name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a schedule's display name, or None."""
    if not isinstance(value, str) or not value.strip():
        return f"{value!r}: a name is 1-{MAX_DISPLAY_NAME} characters; give one such as nightly-llama"
    if problem := values.control_problem(value):
        return problem
    if len(value) > MAX_DISPLAY_NAME:
        return f"a name of {len(value)} characters; Vertex AI allows at most {MAX_DISPLAY_NAME}: shorten it"
    return None


def network_problem(value: Any) -> str | None:
    """Why ``value`` is not a Vertex AI network (``projects/<number>/global/networks/<name>``), or None."""
    if isinstance(value, str) and _VERTEX_NETWORK.fullmatch(value):
        return None
    return f"{value!r} is not projects/<project number>/global/networks/<network name>"


def count_problem(value: Any, low: int, high: int) -> str | None:
    """Why ``value`` is not a whole number in ``low..high``, or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{value!r} is not a whole number; give {low} to {high:,}"
    if not low <= value <= high:
        return f"{value:,} is outside {low} to {high:,}; give a count in that range"
    return None


def max_concurrent_runs_problem(value: Any, target: str) -> str | None:
    """Why ``value`` cannot be a schedule's ``max_concurrent_runs`` on ``target``, or None."""
    high = MAX_KFP_CONCURRENT_RUNS if target == "kfp" else MAX_VERTEX_CONCURRENT_RUNS
    problem = count_problem(value, 1, high)
    if problem and target == "kfp" and isinstance(value, int) and value > high:
        return f"{value:,} is over KFP's limit: its API server accepts max_concurrency 1 to {high}; give at most {high}"
    return problem


def experiment_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a KFP experiment name (1-128 characters, no control characters), or None."""
    return display_name_problem(value)


def target_issues(target: str, vertex: Any = None, kfp: Any = None) -> list[tuple[str, str]]:
    """``(field, message)`` for every bad setting of a :class:`~multislice.delivery.submission.VertexTarget`
    or :class:`~multislice.delivery.submission.KfpTarget`; empty when they can be sent.

    Checks the values the user gives (project, location, service account, network, labels; host or
    ``$KF_PIPELINES_ENDPOINT``, namespace, experiment, service account); a ready ``client`` given to a
    :class:`KfpTarget` is used as it is.
    """
    issues: list[tuple[str, str]] = []

    def check(field: str, value: Any, problem: Any) -> None:
        if value is not None and (found := problem(value)):
            issues.append((field, found))

    if target == "vertex" and vertex is not None:
        if vertex.project is None:
            issues.append(("--project", "required with --target vertex"))
        if vertex.location is None:
            issues.append(("--location", "required with --target vertex"))
        check("--project", vertex.project, project_problem)
        check("--location", vertex.location, vertex_location_problem)
        check("--service-account", vertex.service_account, gcp_service_account_problem)
        check("--network", vertex.network, network_problem)
        if vertex.pipeline_root is not None and (
            not isinstance(vertex.pipeline_root, str)
            or not vertex.pipeline_root.startswith("gs://")
            or values.gcs_path_problem(vertex.pipeline_root)
        ):
            problem = isinstance(vertex.pipeline_root, str) and values.gcs_path_problem(vertex.pipeline_root)
            issues.append(("--pipeline-root", problem or f"{vertex.pipeline_root!r}: give gs://BUCKET/PATH"))
    if target == "kfp" and kfp is not None and kfp.client is None:
        if kfp.host is not None:
            check("--host", kfp.host, host_problem)
        elif os.environ.get(KFP_ENDPOINT_ENV):
            check(f"${KFP_ENDPOINT_ENV}", os.environ[KFP_ENDPOINT_ENV], host_problem)
        check("--kfp-namespace", kfp.namespace, kfp_namespace_problem)
    if target == "kfp" and kfp is not None:
        check("--experiment", kfp.experiment, experiment_problem)
        check("--service-account", kfp.service_account, kubernetes_service_account_problem)
    return issues


def cron_problem(
    expression: str,
    timezone: str | None,
    since: datetime.datetime | None = None,
    end: datetime.datetime | None = None,
) -> str | None:
    """Why a valid 5-field cron never fires after ``since`` (default now) and before ``end``, or None.

    croniter's search for the next fire time (``get_next``) gives up with ``CroniterBadDateError``
    when none falls within 50 years (croniter 7, ``max_years_between_matches``); February 29 is
    found (every 4 years). Day-of-month and day-of-week restricted together fire on either (cron's
    rule; robfig/cron v1 ``dayMatches`` and Vertex AI's unix-cron alike), as croniter computes.
    """
    from croniter import CroniterBadDateError, croniter

    zone = zoneinfo.ZoneInfo(timezone or "UTC")
    base = since or datetime.datetime.now(datetime.UTC)
    try:
        first = croniter(expression.replace("?", "*"), base.astimezone(zone)).get_next(datetime.datetime)
    except CroniterBadDateError:
        return (
            f"{expression!r} never fires (no date matches day-of-month and month, e.g. 31 in a 30-day month or "
            "30/31 February); give a day that exists in the month(s)"
        )
    if end is not None and first > end:
        return (
            f"{expression!r} first fires at {first.isoformat()}, after end_time {end.isoformat()}: it would never run"
        )
    return None


#: The packaged profiles' placeholders (``configs/gke-v6e-16x2*.yaml``: "Replace output_dir, the cluster and the
#: images with your own before running"): a value holding one would only fail after the run started.
PLACEHOLDER = re.compile(r"\byour-(bucket|project|cluster)\b")
#: What to give instead of a placeholder, by pipeline parameter (or compiled-in field), in ``--set`` form.
_PLACEHOLDER_FIXES = {
    "output_dir": "gs://BUCKET/PATH (your bucket)",
    "cluster_project": "PROJECT_ID (the GKE cluster's project)",
    "cluster_name": "CLUSTER (your GKE cluster's name)",
    "trainer_image": "REGISTRY/PATH/multislice-trainer@sha256:... ",
    "images.pipeline": "REGISTRY/PATH/multislice-pipeline@sha256:... ",
    "service_accounts.trainer_gcp_service_account": "ACCOUNT@PROJECT.iam.gserviceaccount.com",
}
#: ``multislice images build`` writes both images' references by digest; ``make images PUSH=1`` does the same.
_IMAGES_FIX = (
    "(`multislice images build --cloud-build --project P --repo LOCATION-docker.pkg.dev/P/REPO` prints it, "
    "or `make images PUSH=1 IMAGE_REPO=REGISTRY/PATH`)"
)


def image_registry_problem(reference: str) -> str | None:
    """Why a cluster could not pull ``reference`` as this project's image; None when it may.

    A reference whose name has no ``/`` (``multislice-pipeline:0.1.0``, the packaged profiles' images) names no
    registry: the container runtime resolves it to Docker Hub's official images (``docker.io/library/NAME``: the
    distribution reference rules, ``github.com/distribution/reference`` ``normalize.go`` ``ParseNormalizedNamed``),
    where no image of this project is, so every pod of the run would fail to pull it.
    """
    name = reference.split("@", 1)[0]
    if "/" in name:
        return None
    return (
        f"{reference} names no registry (the runtime would pull docker.io/library/{name.split(':', 1)[0]}, "
        "not this project's image)"
    )


def placeholder_issues(
    data: Any, parameter_of: Any = None, compiled_in: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """``(field, message)`` for every placeholder a remote run (``submit``, ``schedule create``) would send.

    Refused: a string holding ``your-bucket``, ``your-project`` or ``your-cluster`` (:data:`PLACEHOLDER`), and an
    image (``images.trainer``, ``images.pipeline``) that names no registry (:func:`image_registry_problem`: the
    profiles' unbuilt ``multislice-trainer:0.1.0``). Each is named by the pipeline parameter that sets it
    (``parameter_of(path)``, e.g. ``output_dir``, ``cluster_project``, ``trainer_image``), else by its dotted path,
    with the ``--set`` that fixes it; a field no parameter sets and not in ``compiled_in`` is fixed in a profile of
    one's own.

    Args:
        data: The validated run spec as plain data (:func:`multislice.config.spec_to_data`).
        parameter_of: ``dotted path -> parameter name or None``; None names every field by its path.
        compiled_in: Dotted paths a remote run takes as ``--set`` and compiles in (``images.pipeline``).
    """
    found: list[tuple[str, str, str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}.{index}")
        elif isinstance(node, str) and (match := PLACEHOLDER.search(node)):
            found.append((path, node, f"{node!r} is the profile's placeholder ({match.group(0)})"))

    walk(data, "")
    for image in ("trainer", "pipeline"):
        reference = (data.get("images") or {}).get(image)
        if isinstance(reference, str) and (problem := image_registry_problem(reference)):
            found.append((f"images.{image}", reference, f"{problem}: an image nobody built and pushed"))
    issues = []
    for path, _, why in found:
        name = (parameter_of(path) if parameter_of else None) or path
        example = _PLACEHOLDER_FIXES.get(name, "YOUR-VALUE")
        if (parameter_of and parameter_of(path)) or path in compiled_in:
            fix = f"give your own: --set {name}={example.strip()}"
        else:
            fix = f"set {path} in a profile of your own (a copy of the packaged one, --profile PATH.yaml)"
        if path.startswith("images."):
            fix += f" {_IMAGES_FIX}"
        issues.append((name, f"{why}; {fix}"))
    return issues
