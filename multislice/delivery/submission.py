"""Submit a pipeline run to Vertex AI Pipelines or to a Kubeflow Pipelines endpoint (``multislice submit``).

``multislice.submit(profile, parameters, target=...)`` and the CLI do the same:

1. validate ``parameters`` against the pipeline's parameters (names and
   Python types, :mod:`multislice.config.parameters`) and then the whole run spec with
   the same pydantic models the pipeline's plan step uses
   (:func:`multislice.config.load_spec`); a bad value raises
   :class:`multislice.config.ConfigError` naming the parameter, before any
   request is sent;
2. compile the profile's pipeline for the target (:mod:`multislice.delivery.targets`);
3. send it: for ``vertex`` an ``aiplatform.PipelineJob`` (parameter values,
   pipeline root, service account, network, labels) submitted with
   ``PipelineJob.submit``; for ``kfp`` the real ``kfp.Client``: read the
   server's version and refuse one older than :data:`MIN_KFP_BACKEND`, then
   reuse the pipeline version whose content hash matches (or upload the
   pipeline or a new version of it), then create a run of that version in
   an experiment (in the KFP namespace when given).

Every run is sent with every pipeline parameter's value, explicitly, and
with a unique ``run_name`` (``<profile run_name>-<UTC timestamp>`` unless one
is given), so a run never writes into another run's checkpoints. Continuing
an earlier run (resuming from its checkpoints) is an explicit choice:
``continue_run=<its run name>`` (``multislice submit --continue RUN``) sends
``run_name=RUN`` and ``unique_run_name=false``; the run's admit steps replace
the JobSets the earlier run left finished, and a stage whose final
checkpoint exists is not trained again. Submitting the same run name twice
never collides on the services: the Vertex AI ``job_id`` and the KFP
pipeline version's name are ``<run_name>-<8 random hex characters>``
(a Vertex job ID is unique per project and location; KFP keeps a unique
index on a pipeline's version names).

Sources: google-cloud-aiplatform ``PipelineJob`` (``template_path``,
``parameter_values``, ``pipeline_root``, ``job_id``; ``submit(service_account,
network)``); kfp 2.17 ``kfp.Client`` (``upload_pipeline``,
``upload_pipeline_version``, ``create_experiment``, ``run_pipeline``) over the
KFP v2beta1 REST API.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from multislice import config, identity, release
from multislice.config import ConfigError
from multislice.config import parameters as pipeline_parameters
from multislice.delivery import checks
from multislice.delivery.results import RunRef
from multislice.errors import InputError, RunFailed, translated

#: The pipeline's name in KFP (``upload_pipeline``'s ``pipeline_name``) and Vertex AI labels.
PIPELINE_NAME = "multislice-training"
#: The oldest KFP backend the compiled pipeline runs on: the exit handler (``cleanup``) takes
#: ``PipelineTaskFinalStatus``, which backends before 2.14.0 refuse ("task final status not supported yet",
#: kubeflow/pipelines#11641, fixed by #11953, first released in the backend's tag 2.14.0).
MIN_KFP_BACKEND = (2, 14, 0)
#: Vertex AI label rules (https://cloud.google.com/vertex-ai/docs/reference/rest/v1/projects.locations.pipelineJobs,
#: ``labels``; https://cloud.google.com/resource-manager/docs/labels-overview#requirements): at most 64
#: labels; keys and values at most 63 characters of lowercase letters, digits, ``_`` and ``-``; keys start
#: with a lowercase letter and are not empty. (International characters are allowed by Google Cloud;
#: this check keeps to ASCII.)
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
DEFAULT_EXPERIMENT = "multislice"
#: Run spec fields that are no pipeline parameter but that ``submit`` and ``schedule create`` take (``--set``) and
#: compile in, as :data:`multislice.config.parameters.LOCAL_ONLY`'s: the pipeline components' image and the trainer's
#: Google service account, which the packaged profiles give as placeholders
#: (:func:`multislice.delivery.checks.placeholder_issues`).
COMPILED_IN: frozenset[str] = frozenset({"images.pipeline", "service_accounts.trainer_gcp_service_account"})
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class VertexTarget:
    """Where a run goes on Vertex AI Pipelines.

    Attributes:
        project: Google Cloud project ID.
        location: Region, e.g. ``us-east5``.
        pipeline_root: ``gs://`` directory for the pipeline's artifacts; default
            ``<output_dir>/pipeline-root`` when ``output_dir`` is on GCS.
        service_account: Service account the run's components run as (needs
            access to the GKE cluster and the bucket); None for Vertex's default.
        network: VPC network to peer, ``projects/<number>/global/networks/<name>``.
        labels: Labels of the PipelineJob (Vertex label rules: lower-case keys and values).
        credentials: ``google.auth`` credentials; None for the environment's
            default credentials (tests pass ``AnonymousCredentials``).
    """

    project: str
    location: str
    pipeline_root: str | None = None
    service_account: str | None = None
    network: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    credentials: Any = None


@dataclass(frozen=True)
class KfpTarget:
    """Where a run goes on Kubeflow Pipelines.

    Attributes:
        host: The KFP API endpoint, e.g. ``https://<id>.pipelines.googleusercontent.com``
            or ``http://localhost:8888`` (a port-forward of ``ml-pipeline-ui``).
        experiment: Experiment the runs are grouped in (created when missing).
        namespace: Kubeflow profile namespace (multi-user KFP); None for single-user.
        service_account: Kubernetes service account of the run's pods (KFP's
            default when None); it needs RBAC for JobSets and Kueue objects.
        existing_token: A bearer token for the endpoint, if it needs one.
        client: A ready ``kfp.Client`` (then host, namespace and token are not used).
        check_version: Read the server's version (healthz ``tag_name``) and refuse one older than
            :data:`MIN_KFP_BACKEND` before uploading anything; False for a server that reports none.
    """

    host: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    namespace: str | None = None
    service_account: str | None = None
    existing_token: str | None = None
    client: Any = None
    check_version: bool = True

    @translated
    def make_client(self) -> Any:
        """The ``kfp.Client`` for this endpoint (kfp reads the server's healthz here).

        Raises:
            multislice.errors.InputError: the endpoint cannot be reached or refuses (as the CLI says it).
        """
        if self.client is not None:
            return self.client
        import kfp

        kwargs: dict[str, Any] = {"host": self.host, "existing_token": self.existing_token}
        if self.namespace:
            kwargs["namespace"] = self.namespace
        with warnings.catch_warnings():
            # kfp.Client warns on every construction that it needs a v2 server; check_version tells that instead.
            warnings.filterwarnings("ignore", message="This client only works with", category=FutureWarning)
            return kfp.Client(**kwargs)


@dataclass(frozen=True)
class SubmittedRun:
    """A run that was sent.

    Attributes:
        target: ``vertex`` or ``kfp``.
        run_name: The run's name (its output directory under ``output_dir``).
        run_id: Vertex: the PipelineJob's resource name; KFP: the run ID.
        parameters: Every parameter value sent, by pipeline parameter name.
        pipeline_id: KFP: the pipeline's ID; Vertex: ''.
        version_id: KFP: the pipeline version's ID; Vertex: ''.
        job: The ``aiplatform.PipelineJob`` (Vertex) or the ``V2beta1Run`` (KFP).
    """

    target: str
    run_name: str
    run_id: str
    parameters: dict[str, Any]
    pipeline_id: str = ""
    version_id: str = ""
    job: Any = None


@dataclass(frozen=True)
class Request:
    """What a submission or a schedule would send, built without sending anything (``--dry-run``).

    Attributes:
        target: ``vertex`` or ``kfp``.
        run_name: The run's name (a schedule's base name, each run appending its id unless it continues one run).
        pipeline: The pipeline and the version it would be uploaded as (KFP: :func:`content_version_name`, a
            version with that name is reused) or the template (Vertex AI).
        template_bytes: Size of the compiled pipeline YAML, bytes.
        parameters: Every parameter value that would be sent, by pipeline parameter name.
        settings: The request's other fields, in words (where it goes, labels, the schedule's cron...).
        notes: What the values of the profile were changed to, in words (a checkpoint period that follows the steps).
    """

    target: str
    run_name: str
    pipeline: str
    template_bytes: int
    parameters: dict[str, Any]
    settings: dict[str, Any]
    notes: tuple[str, ...] = ()


def default_run_name(base: str, now: datetime.datetime | None = None) -> str:
    """``<base>-<YYYYmmdd-HHMMSS>`` (UTC): a run name no earlier run has, as ``multislice run`` makes."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%d-%H%M%S")
    return f"{base}-{stamp}"


def submission_id(run_name: str) -> str:
    """``<run_name>-<8 random hex characters>``: a Vertex AI job ID or KFP version name no other submission has.

    Vertex job IDs match ``[a-z][-a-z0-9]{0,127}`` (the run name, a DNS-1035
    label, does); a run submitted again under the same run name gets a new one.
    """
    return f"{run_name[:118]}-{uuid.uuid4().hex[:8]}"


_RUN_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _check_type(name: str, kind: type, value: Any) -> str | None:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if ok:
        return None
    return f"expected {_TYPE_NAMES[kind]}, got {value!r} ({type(value).__name__}); e.g. {name}=<{_TYPE_NAMES[kind]}>"


def validate_parameters(
    profile: Mapping[str, Any], values: Mapping[str, Any] | None = None
) -> tuple[config.RunSpec, dict[str, Any]]:
    """Check pipeline parameter values for a profile and return every parameter's value to send.

    Args:
        profile: The profile's content (``multislice.config.read_profile``).
        values: ``{pipeline parameter name: value}``; names are those of the
            compiled pipeline (``run_name``, ``num_slices``, ``stage1_steps``, ...).

    Returns:
        ``(spec, arguments)``: the validated run spec, and ``{name: value}``
        for every parameter of the remote pipeline (given or the profile's), typed as the
        pipeline declares. A value for a parameter the remote pipeline does not offer
        (:data:`multislice.config.parameters.LOCAL_ONLY`: ``backend``) is checked and goes
        into the spec, not into the arguments: :func:`submit` compiles it in.

    Raises:
        ConfigError: an unknown parameter name (with the known ones), a value
            of the wrong type, or any problem :func:`multislice.config.load_spec`
            finds; each names its field and the fix.
    """
    values = dict(values or {})
    spec = config.load_spec(profile)
    known = pipeline_parameters.parameter_values(spec, remote=False)
    issues = []
    for name, value in values.items():
        if name in COMPILED_IN:
            kind: type = str
        elif name not in known:
            close = difflib.get_close_matches(name, [*known, *sorted(COMPILED_IN)], n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}? " if close else ""
            issues.append((name, f"unknown pipeline parameter; {hint}known parameters: {', '.join(known)}, "
                                 f"and {', '.join(sorted(COMPILED_IN))} (compiled in)"))  # fmt: skip
            continue
        else:
            kind = known[name][0]
        problem = _check_type(name, kind, value)
        if problem:
            issues.append((name, problem))
    if issues:
        # The other values are checked too, so one bad name does not hide a bad value (every problem at once).
        good = {k: v for k, v in values.items() if k not in {f for f, _ in issues}}
        try:
            config.load_spec(profile, good)
        except ConfigError as error:
            issues += error.issues
        raise ConfigError(issues)
    spec = config.load_spec(profile, values)
    arguments = {name: value for name, (_, value) in pipeline_parameters.parameter_values(spec, remote=True).items()}
    return spec, arguments


def prepare(
    profile: Mapping[str, Any], values: Mapping[str, Any] | None, target: str, continue_run: str | None = None
) -> tuple[config.RunSpec, dict[str, Any]]:
    """Validate parameters for a remote target and give the run a unique name when none is set.

    With ``continue_run`` (an earlier run's full run name, the last part of
    its run directory) the run continues it: ``run_name`` is that name and
    ``unique_run_name`` false, so it resumes from that run's checkpoints.

    Raises:
        ConfigError: as :func:`validate_parameters`, ``backend: local`` (a
            remote run cannot use this machine's processes), and a
            ``continue_run`` that is no run name or disagrees with ``run_name``/``unique_run_name``.
    """
    values = dict(values or {})
    if continue_run is not None:
        issues = []
        if not _RUN_NAME.fullmatch(continue_run):
            issues.append(
                (
                    "--continue",
                    f"{continue_run!r} is not a run name; give the earlier run's run_name as "
                    "it ran (the last part of its run directory, e.g. nightly-ab12cd34)",
                )
            )
        for key, wanted in (("run_name", continue_run), ("unique_run_name", False)):
            if key in values and values[key] != wanted:
                issues.append(
                    (
                        key,
                        f"{values[key]!r} contradicts --continue {continue_run}: a continued run keeps "
                        f"its name; drop {key}",
                    )
                )
        if issues:
            raise ConfigError(issues)
        values.update(run_name=continue_run, unique_run_name=False)
    if "run_name" not in values:
        values["run_name"] = default_run_name(str(profile.get("run_name", "run")))
    spec, arguments = validate_parameters(profile, values)
    issues = []
    if spec.backend == "local":
        issues.append(
            ("backend", f"backend=local runs pods as processes on this machine, not on {target}; "
                        "set backend=gke (and output_dir=gs://...) or use `multislice run` locally")
        )  # fmt: skip
    issues += placeholder_issues(spec)
    if issues:
        raise ConfigError(issues)
    return spec, arguments


def placeholder_issues(spec: config.RunSpec) -> list[tuple[str, str]]:
    """The profile's placeholders a remote run would send (``gs://your-bucket/...``, ``your-project``,
    ``your-cluster``, an unbuilt ``multislice-trainer:0.1.0``), each named by its pipeline parameter with the
    ``--set`` that fixes it: :func:`multislice.delivery.checks.placeholder_issues`, which :func:`prepare` applies for
    ``submit``, its dry run and ``schedule create``, before anything is compiled or any service contacted."""
    offered = [p for p in pipeline_parameters.RUN_PARAMETERS if p.name not in pipeline_parameters.LOCAL_ONLY]
    by_path = {p.path: p.name for p in offered}
    return checks.placeholder_issues(config.spec_to_data(spec), by_path.get, COMPILED_IN)


def compiled_profile(profile: Mapping[str, Any], values: Mapping[str, Any] | None) -> dict[str, Any]:
    """The profile to compile for a remote run: with the values of parameters a remote pipeline does not
    offer (:data:`multislice.config.parameters.LOCAL_ONLY`: ``backend``) compiled in."""
    fixed = {k: v for k, v in (values or {}).items() if k in pipeline_parameters.LOCAL_ONLY or k in COMPILED_IN}
    return config.apply_overrides(profile, fixed)


def compile_for(profile: Mapping[str, Any], target: str, directory: str | Path) -> Path:
    """Compile the profile's pipeline for ``target`` into ``directory``; returns the YAML path."""
    from pipelines.multislice_training import compile_pipeline  # kfp (2-5 s): only when compiling

    path = Path(directory) / f"pipeline.{target}.yaml"
    compile_pipeline(dict(profile), str(path), target=target)
    return path


def vertex_job(
    template_path: str | Path, spec: config.RunSpec, arguments: Mapping[str, Any], where: VertexTarget
) -> Any:
    """Build (not send) the ``aiplatform.PipelineJob`` of a run; works offline.

    The display name is the run name, the job ID :func:`submission_id` (a
    second submission of one run name does not collide); caching is off, as in the
    compiled pipeline; the labels are ``where.labels`` plus
    ``multislice-pipeline``.

    Raises:
        ConfigError: no pipeline root (``output_dir`` not on GCS and none given).
    """
    from google.cloud import aiplatform

    root = vertex_pipeline_root(spec, where)
    return aiplatform.PipelineJob(
        display_name=spec.run_name,
        template_path=str(template_path),
        job_id=submission_id(spec.run_name),
        pipeline_root=root,
        parameter_values=dict(arguments),
        enable_caching=False,
        labels={"multislice-pipeline": PIPELINE_NAME, **check_labels(where.labels)},
        project=where.project,
        location=where.location,
        credentials=where.credentials,
    )


def vertex_pipeline_root(spec: config.RunSpec, where: VertexTarget) -> str:
    """The run's Vertex AI pipeline root: ``where.pipeline_root``, else ``<output_dir>/pipeline-root`` on GCS.

    Raises:
        ConfigError: no ``gs://`` root (``output_dir`` not on GCS and none given).
    """
    root = where.pipeline_root
    if not root and spec.output_dir.startswith("gs://"):
        root = f"{spec.output_dir.rstrip('/')}/pipeline-root"
    if not root or not root.startswith("gs://"):
        raise ConfigError(
            [("pipeline_root", "Vertex AI needs a gs:// pipeline root for the run's artifacts; give "
                               "--pipeline-root gs://BUCKET/path or set output_dir to a gs:// path")]
        )  # fmt: skip
    return root


def request_for(
    spec: config.RunSpec,
    arguments: Mapping[str, Any],
    template: Path,
    where: VertexTarget | KfpTarget,
    notes: tuple[str, ...] = (),
) -> Request:
    """The :class:`Request` :func:`submit` would send for a validated run and its compiled ``template``; offline.

    ``where`` is the target's settings, as :func:`check_target` returned them.

    Raises:
        ConfigError: Vertex AI with no ``gs://`` pipeline root (:func:`vertex_pipeline_root`).
    """
    if isinstance(where, VertexTarget):
        target = "vertex"
        settings: dict[str, Any] = {
            "project": where.project,
            "location": where.location,
            "pipeline root": vertex_pipeline_root(spec, where),
            "job id": f"{spec.run_name[:118]}-<8 random hex characters, chosen when sent>",
            "display name": spec.run_name,
            "service account": where.service_account or "(Vertex AI's default)",
            "network": where.network or "(none)",
            "labels": {"multislice-pipeline": PIPELINE_NAME, **check_labels(where.labels)},
            "caching": "off",
        }
        pipeline = f"template {PIPELINE_NAME} (compiled for vertex, sent with the job)"
    else:
        target = "kfp"
        settings = {
            "host": where.host or "(from $KF_PIPELINES_ENDPOINT or the in-cluster default)",
            "experiment": where.experiment,
            "kfp namespace": where.namespace or "(single-user)",
            "service account": where.service_account or "(KFP's default)",
            "server version": f"checked >= {'.'.join(map(str, MIN_KFP_BACKEND))} before the upload"
            if where.check_version
            else "not checked (--no-version-check)",
            "caching": "off",
        }
        pipeline = f"{PIPELINE_NAME}, version {content_version_name(template)} (reused when the server has it)"
    size = Path(template).stat().st_size
    return Request(target, spec.run_name, pipeline, size, dict(arguments), settings, tuple(notes))


def dry_run(
    profile: str | Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
    *,
    target: str,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
    continue_run: str | None = None,
) -> Request:
    """Everything :func:`submit` checks and compiles, and what it would send, with nothing sent.

    No client is built, so no credentials and no network are needed: the target's settings, the
    parameters and the run spec are validated, and the pipeline compiled, as :func:`submit` does.

    Raises:
        ConfigError: as :func:`submit`, before it would send anything.
    """
    where = check_target(target, vertex, kfp)
    data = config.read_profile(profile) if isinstance(profile, str) else dict(profile)
    spec, arguments = prepare(data, parameters, target, continue_run)
    notes = tuple(f.describe() for f in config.followed_checkpoint_periods(data, dict(parameters or {})))
    data = compiled_profile(data, parameters)
    with tempfile.TemporaryDirectory() as tmp:
        template = compile_for(data, target, tmp)
        return request_for(spec, arguments, template, where, notes)


def check_labels(labels: Mapping[str, Any], field_name: str = "--label") -> dict[str, str]:
    """Labels as strings, checked against Vertex AI's label rules (see :data:`MAX_LABELS`).

    Values are kept as written (never YAML-parsed: ``n=007`` stays ``"007"``).

    Raises:
        ConfigError: a non-string key or value, a bad key or value, or more than 64 labels; each named.
    """
    issues = []
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            issues.append((f"{field_name} {key}", f"labels are strings; got {value!r} ({type(value).__name__})"))
        elif not _LABEL_KEY.fullmatch(key):
            issues.append((f"{field_name} {key}", "a label key is 1 to 63 lowercase letters, digits, '_' or '-', "
                                                  "starting with a letter, e.g. team=ml-platform"))  # fmt: skip
        elif not _LABEL_VALUE.fullmatch(value):
            issues.append((f"{field_name} {key}", f"label value {value!r}: at most 63 lowercase letters, digits, "
                                                  "'_' or '-'"))  # fmt: skip
    if len(labels) > MAX_LABELS:
        issues.append((field_name, f"{len(labels)} labels; Vertex AI allows at most {MAX_LABELS}"))
    if issues:
        raise ConfigError(issues)
    return dict(labels)


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--label``) as a label mapping, values as written; checked by :func:`check_labels`.

    Raises:
        ConfigError: a pair without ``=``, or a label Vertex AI would refuse.
    """
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError([("--label", f"{pair!r} is not KEY=VALUE, e.g. --label team=ml-platform")])
        labels[key] = value
    return check_labels(labels)


class KfpBackendTooOld(ConfigError):
    """The KFP server is older than :data:`MIN_KFP_BACKEND` (or does not say its version)."""


def kfp_server_version(client: Any) -> str:
    """The KFP server's version: ``tag_name`` of ``GET /apis/v2beta1/healthz``.

    The API server's own HTTP handler writes ``commit_sha``, ``tag_name``, ``multi_user`` (and
    ``pipeline_store``) there (kubeflow/pipelines ``backend/src/apiserver/main.go``, 2.0 to 2.17);
    kfp_server_api's ``V2beta1GetHealthzResponse`` model keeps only ``multi_user``, so the body is
    read raw through the client's own healthz API (``_preload_content=False``).
    """
    response = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    return str(json.loads(response.data or b"{}").get("tag_name", "unknown"))


def check_kfp_server(client: Any) -> str:
    """Refuse a KFP server older than :data:`MIN_KFP_BACKEND`; returns its version.

    Raises:
        KfpBackendTooOld: an older server, or one whose ``tag_name`` is not a version (``unknown``).
    """
    tag = kfp_server_version(client)
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", tag)
    minimum = ".".join(map(str, MIN_KFP_BACKEND))
    if match is None:
        raise KfpBackendTooOld([("kfp server", f"the server reports version {tag!r}, not X.Y.Z; the pipeline needs "
                                               f"KFP >= {minimum}: upgrade it, or pass --no-version-check if it is "
                                               "that new")])  # fmt: skip
    if tuple(int(g) for g in match.groups()) < MIN_KFP_BACKEND:
        cause = f"KFP {tag} is older than {minimum}: its exit handler cannot take PipelineTaskFinalStatus"
        fix = f"(kubeflow/pipelines#11641); upgrade the KFP backend to {minimum} or later; nothing was uploaded"
        raise KfpBackendTooOld([("kfp server", f"{cause} {fix}")])
    return tag


def content_version_name(template_path: str | Path) -> str:
    """A pipeline version name from the compiled YAML's content: ``<package version>-<sha256[:12]>``.

    Two submissions of an unchanged pipeline get the same name, so the version is reused
    (:func:`_kfp_upload`) instead of uploaded again; any change to the YAML gives a new one.
    """
    digest = hashlib.sha256(Path(template_path).read_bytes()).hexdigest()[:12]
    return f"{PIPELINE_NAME}-{release.version()}-{digest}".replace(".", "-").replace("+", "-")


def _compiled_by() -> str:
    return f"compiled by multislice-pipelines {release.version()} (profile schema {release.schema_fingerprint()})"


def _find_pipeline(client: Any, namespace: str | None) -> str | None:
    if not namespace:
        return client.get_pipeline_id(PIPELINE_NAME)
    found = client.list_pipelines(filter=_name_filter(PIPELINE_NAME), namespace=namespace).pipelines or []
    return found[0].pipeline_id if found else None


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def _kfp_upload(
    client: Any, template_path: Path, description: str, namespace: str | None = None
) -> tuple[str, str, bool]:
    """The pipeline's version for this YAML: reused when one with its content hash exists, else uploaded
    (the pipeline itself too when missing; in ``namespace`` on a multi-user KFP).

    Returns:
        ``(pipeline_id, version_id, reused)``.
    """
    name = content_version_name(template_path)
    pipeline_id = _find_pipeline(client, namespace)
    if pipeline_id is None:
        pipeline = client.upload_pipeline(
            str(template_path), pipeline_name=PIPELINE_NAME, description=description, namespace=namespace
        )
        pipeline_id = pipeline.pipeline_id
    else:
        versions = client.list_pipeline_versions(pipeline_id, filter=_name_filter(name)).pipeline_versions or []
        if versions:
            return pipeline_id, versions[0].pipeline_version_id, True
    version = client.upload_pipeline_version(
        str(template_path), pipeline_version_name=name, pipeline_id=pipeline_id, description=description
    )
    return pipeline_id, version.pipeline_version_id, False


@translated
def submit(
    profile: str | Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
    *,
    target: str,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
    continue_run: str | None = None,
) -> SubmittedRun:
    """Validate, compile and submit one run of the profile's pipeline.

    Args:
        profile: A profile name in ``configs/``, a path to a ``.yaml``, or its content.
        parameters: Pipeline parameter values, e.g. ``{"stage1_steps": 500}``.
        target: ``vertex`` or ``kfp``.
        vertex: Where on Vertex AI (``target="vertex"``).
        kfp: Which KFP endpoint (``target="kfp"``).
        continue_run: An earlier run's run name to continue (resume from its checkpoints); see :func:`prepare`.

    Returns:
        The :class:`SubmittedRun`.

    Raises:
        ConfigError: bad parameters or a missing target setting, before anything is sent.
        multislice.errors.UserError: what the CLI's ``submit`` reports too (:func:`multislice.errors.expected_error`,
            the client library's error as ``__cause__``): no Google Cloud credentials (``InputError``), the KFP
            endpoint unreachable or refusing (``InputError``), the Google Cloud API refusing (``RunFailed``).
    """
    where = check_target(target, vertex, kfp)
    data = config.read_profile(profile) if isinstance(profile, str) else dict(profile)
    spec, arguments = prepare(data, parameters, target, continue_run)
    data = compiled_profile(data, parameters)
    reached = connect(where)  # credentials and the endpoint before the compile (seconds to minutes of CPU)
    with tempfile.TemporaryDirectory() as tmp:
        template = compile_for(data, target, tmp)
        if isinstance(reached, VertexTarget):
            job = vertex_job(template, spec, arguments, reached)
            job.submit(service_account=reached.service_account, network=reached.network)
            return SubmittedRun("vertex", spec.run_name, job.resource_name, arguments, job=job)
        assert isinstance(where, KfpTarget)  # reached is its client
        client = reached
        pipeline_id, version_id, _ = _kfp_upload(client, template, _compiled_by(), where.namespace)
        experiment = client.create_experiment(where.experiment, namespace=where.namespace)
        run = client.run_pipeline(
            experiment_id=experiment.experiment_id,
            job_name=spec.run_name,
            pipeline_id=pipeline_id,
            version_id=version_id,
            params=arguments,
            enable_caching=False,
            service_account=where.service_account,
        )
        return SubmittedRun("kfp", spec.run_name, run.run_id, arguments, pipeline_id, version_id, job=run)


def connect(where: VertexTarget | KfpTarget) -> Any:
    """Reach the target before anything is compiled: a missing credential or an endpoint that does not answer is
    refused in a second, not after the pipeline's compile (46-158 s on a loaded machine).

    Vertex AI: the credentials aiplatform would use (``where.credentials``, else those ``aiplatform.init`` set,
    else the environment's default credentials, ``google.auth.default``, as aiplatform's
    ``initializer.global_config.credentials`` finds them), returned in a copy of ``where``. KFP: the
    ``kfp.Client`` (which reads the server's healthz), with the server's version checked
    (:func:`check_kfp_server`) unless ``where.check_version`` is False.

    Returns:
        The :class:`VertexTarget` with its credentials, or the KFP client.

    Raises:
        google.auth.exceptions.DefaultCredentialsError: no credentials (the CLI and :func:`submit` say it as
            ``InputError``, :func:`multislice.errors.expected_error`).
        multislice.errors.InputError: the KFP endpoint cannot be reached or refuses.
        KfpBackendTooOld: a KFP server older than :data:`MIN_KFP_BACKEND`.
    """
    if isinstance(where, KfpTarget):
        client = where.make_client()
        if where.check_version:
            check_kfp_server(client)  # before anything is uploaded
        return client
    if where.credentials is not None:
        return where
    initialized = sys.modules.get("google.cloud.aiplatform.initializer")
    if initialized is not None and getattr(initialized.global_config, "_credentials", None) is not None:
        return where  # aiplatform.init(credentials=...): aiplatform uses those
    import google.auth

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    return dataclasses.replace(where, credentials=credentials)


def check_target(target: str, vertex: VertexTarget | None, kfp: KfpTarget | None) -> VertexTarget | KfpTarget:
    """Refuse an unknown target, a missing target setting, or a setting the service would refuse.

    Runs before anything is compiled and before any client is built (:mod:`multislice.delivery.checks`).

    Returns:
        The target's settings: ``vertex`` for ``"vertex"``, ``kfp`` for ``"kfp"``.

    Raises:
        ConfigError: each bad setting named (``--project``, ``--location``, ``--service-account``,
            ``--host``, ``--kfp-namespace``, ...) with its rule.
    """
    if target not in ("vertex", "kfp"):
        raise ConfigError([("target", f"unknown target {target!r}; use vertex or kfp")])
    where = vertex if target == "vertex" else kfp
    if where is None:
        raise ConfigError([(target, f"target={target} needs its settings (the {target}= argument)")])
    issues = checks.target_issues(target, vertex, kfp)
    if isinstance(where, VertexTarget):
        try:
            check_labels(where.labels)
        except ConfigError as error:
            issues += error.issues
    if issues:
        raise ConfigError(issues)
    return where


def add_target_arguments(parser: Any) -> None:
    """Add the ``--target`` flags of ``multislice submit`` and ``multislice schedule`` to an argparse parser."""
    parser.add_argument("--target", choices=["vertex", "kfp"], required=True, help="Vertex AI Pipelines or a KFP API")
    vertex = parser.add_argument_group("vertex target")
    vertex.add_argument("--project", help="Google Cloud project ID")
    vertex.add_argument("--location", help="region, e.g. us-east5")
    vertex.add_argument(
        "--pipeline-root", help="gs:// root of the run's artifacts (default <output_dir>/pipeline-root)"
    )
    vertex.add_argument("--network", help="VPC network to peer: projects/<number>/global/networks/<name>")
    vertex.add_argument("--label", action="append", metavar="KEY=VALUE", help="PipelineJob label (repeatable)")
    kfp = parser.add_argument_group("kfp target")
    kfp.add_argument("--host", help="KFP API endpoint, e.g. http://localhost:8888 (or $KF_PIPELINES_ENDPOINT)")
    kfp.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="KFP experiment (created when missing)")
    kfp.add_argument("--kfp-namespace", help="Kubeflow profile namespace (multi-user KFP)")
    kfp.add_argument(
        "--no-version-check",
        action="store_true",
        help=f"do not refuse a KFP server older than {'.'.join(map(str, MIN_KFP_BACKEND))} (or of unknown version)",
    )
    parser.add_argument("--service-account", help="service account of the run (Vertex: GCP; KFP: Kubernetes)")


def targets_from_args(args: Any) -> dict[str, Any]:
    """``{"vertex": VertexTarget}`` or ``{"kfp": KfpTarget}`` from parsed :func:`add_target_arguments` flags.

    Raises:
        ConfigError: ``--target vertex`` without ``--project`` or ``--location``, or a flag of the other
            target (``--host`` with vertex, ``--project`` with kfp, ...), which would be ignored.
    """
    other = {
        "vertex": [("--host", args.host), ("--kfp-namespace", args.kfp_namespace),
                   ("--experiment", None if args.experiment == DEFAULT_EXPERIMENT else args.experiment),
                   ("--no-version-check", getattr(args, "no_version_check", False) or None)],
        "kfp": [("--project", args.project), ("--location", args.location), ("--pipeline-root", args.pipeline_root),
                ("--network", args.network), ("--label", args.label or None)],
    }[args.target]  # fmt: skip
    unused = [(flag, f"applies to the other target, not --target {args.target}; leave it out") for flag, v in other
              if v is not None]  # fmt: skip
    if unused:
        raise ConfigError(unused)
    if args.target == "vertex":
        missing = [(f"--{n}", "required with --target vertex") for n in ("project", "location") if not getattr(args, n)]
        if missing:
            raise ConfigError(missing)
        labels = parse_labels(args.label or [])
        return {"vertex": VertexTarget(args.project, args.location, args.pipeline_root, args.service_account,
                                       args.network, labels)}  # fmt: skip
    return {"kfp": KfpTarget(args.host, args.experiment, args.kfp_namespace, args.service_account,
                             check_version=not getattr(args, "no_version_check", False))}  # fmt: skip


def _set_argument(key: str, value: Any) -> str:
    """``key=value`` for ``--set``: a string as written, anything else as JSON (a YAML subset)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def run_local(
    profile: str | Mapping[str, Any],
    changes: Mapping[str, Any] | None = None,
    *,
    tell: Any = print,
) -> RunRef:
    """Run the profile's pipeline on this machine as ``multislice run`` does, and return the finished run.

    It is ``multislice run --profile PROFILE --set KEY=VALUE ...`` in a child process of this Python
    (an argument list, no shell): the same compile, kfp.local run, summary and exit status; each line it
    prints is passed to ``tell`` as it is printed (progress, then the summary). Interrupting this call
    (Ctrl-C, a notebook's stop button) sends the run SIGTERM, which stops its steps and the JobSets they
    started, as Ctrl-C stops ``multislice run``.

    Args:
        profile: A profile name (``local``), a path to a ``.yaml``, or a profile's content.
        changes: ``--set`` overrides: pipeline parameters (``stage1_steps``) or dotted fields
            (``stages.tiny-8b-recipe.maxtext_overrides.lr_schedule_type``). Without ``run_name`` the run
            gets ``<profile run_name>-<local time>``, as ``multislice run`` names it.
        tell: Called with each line the run prints.

    Returns:
        A :class:`multislice.delivery.results.RunRef` (``target="local"``) for :mod:`multislice.delivery.results`.

    Raises:
        multislice.config.ConfigError: a bad change, before anything starts.
        multislice.errors.InputError: the run refused its input or this machine (exit 2: no trainer
            environment, a run directory another live run owns...), with the CLI's cause and fix.
        multislice.errors.RunFailed: the run failed (exit 1), with the failing step's cause and the full log's path.
    """
    data = config.read_profile(profile) if isinstance(profile, str) else dict(profile)
    changes = dict(changes or {})
    run_name = str(changes.get("run_name") or identity.timestamped_run_name(str(data.get("run_name", "run"))))
    found = identity.run_identity(run_name, str(changes.get("output_dir", data.get("output_dir", ""))))
    changes.update(run_name=found.run_name, output_dir=found.output_dir)
    spec = config.load_spec(data, changes)  # refused here, before a process starts
    sets = [arg for key, value in changes.items() for arg in ("--set", _set_argument(key, value))]
    with tempfile.TemporaryDirectory(prefix="multislice-run-") as tmp:
        if isinstance(profile, str):
            path = profile
        else:
            written = Path(tmp, "profile.yaml")
            written.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
            path = str(written)
        argv = [sys.executable, "-m", "multislice.cli", "run", "--profile", path, *sets]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        lines: list[str] = []
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as child:
            try:
                for line in child.stdout or ():  # stdout=PIPE: never None
                    lines.append(line.rstrip("\n"))
                    tell(lines[-1])
                code = child.wait()
            except KeyboardInterrupt:
                child.send_signal(signal.SIGTERM)  # multislice run stops its steps and their JobSets
                child.wait()
                raise
    if code == 0:
        return RunRef(found.run_name, found.output_dir, [s.name for s in spec.stages], "local")

    def last(prefix: str) -> str:
        return next((line.removeprefix(prefix) for line in reversed(lines) if line.startswith(prefix)), "")

    cause = last("error: ") or last("cause: ") or last("FAILED: ") or f"multislice run exited {code}"
    fix = last("fix: ") or (f"see the run's full log {last('see ')}" if last("see ") else "")
    raise (InputError if code == 2 else RunFailed)(f"local run {found.run_name} failed: {cause}", fix)
