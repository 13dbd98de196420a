"""Pipeline parameters: the fields a user changes per run, and where each lands in the spec.

One table serves the compiled pipeline (its parameter names and types), the
``plan`` step (turning parameter values into overrides) and the CLI's
``--set`` (which accepts these names as well as dotted paths), so a value
goes through the same validation wherever it comes from.
"""

from __future__ import annotations

import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from multislice.config.models import RunSpec, Stage


@dataclass(frozen=True)
class Parameter:
    """One pipeline parameter: its name, Python type, dotted path in the run spec, and run-form description.

    ``optional``: the spec field may be unset (None); as a pipeline parameter (a
    STRING) it is then ``''``, and ``''`` given as its value unsets it.
    """

    name: str
    type: type
    path: str
    description: str
    optional: bool = False


RUN_PARAMETERS: tuple[Parameter, ...] = (
    Parameter("run_name", str, "run_name", "Run name: prefix of JobSet names and output directory"),
    Parameter("backend", str, "backend", "Where steps act: local (this machine) or gke"),
    Parameter("tpu_type", str, "tpu_type", "TPU type of each slice, e.g. v6e-16"),
    Parameter(
        "machine_type",
        str,
        "machine_type",
        "GKE machine type of each TPU host where the topology offers a choice, e.g. ct6e-standard-8t for v6e-8 "
        "on one VM",
        optional=True,
    ),
    Parameter("num_slices", int, "num_slices", "Number of slices joined over DCN"),
    Parameter("output_dir", str, "output_dir", "Base directory (path or gs://) for checkpoints and logs"),
    Parameter("trainer_image", str, "images.trainer", "Trainer container image (MaxText)"),
    Parameter("namespace", str, "namespace", "Kubernetes namespace of the JobSets"),
    Parameter("queue", str, "queue", "Kueue LocalQueue"),
    Parameter("priority", str, "priority", "Kueue WorkloadPriorityClass"),
    Parameter("max_restarts", int, "max_restarts", "JobSet failurePolicy.maxRestarts"),
    Parameter("launcher", str, "launcher", "How stages are launched: jobset or ray (Ray Train JaxTrainer)"),
    Parameter("skip_preflight", bool, "preflight.skip", "Skip the AOT-compile HBM check before provision"),
    Parameter(
        "unique_run_name",
        bool,
        "unique_run_name",
        "Append the pipeline run's id to run_name: a new run "
        "(default of a compiled pipeline); false with run_name an earlier run's full name continues that run",
    ),
    Parameter(
        "notify_webhook_secret",
        str,
        "notify_webhook_secret",
        "Vertex AI: Secret Manager secret version with the webhook URL for the final status ('' for none); "
        "KFP reads the URL from the Kubernetes Secret multislice-notify-webhook",
    ),
    # Where the run goes: the deployment's values, so that one compiled YAML serves any cluster.
    Parameter("cluster_project", str, "cluster.project", "Google Cloud project of the GKE cluster", optional=True),
    Parameter("cluster_location", str, "cluster.location", "Region or zone of the GKE cluster", optional=True),
    Parameter("cluster_name", str, "cluster.name", "GKE cluster name", optional=True),
    Parameter(
        "cluster_access",
        str,
        "cluster.access",
        "How the steps reach the cluster's API: in-cluster (KFP on the same cluster), gke (Vertex AI) or kubeconfig",
    ),
    Parameter(
        "zone", str, "node_pools.zone", "Zone of the TPU node pools ('' when cluster_location is a zone)", optional=True
    ),  # fmt: skip
    Parameter(
        "pipeline_service_account",
        str,
        "service_accounts.pipeline",
        "Kubernetes ServiceAccount of the pipeline components",
    ),  # fmt: skip
    Parameter(
        "trainer_service_account", str, "service_accounts.trainer", "Kubernetes ServiceAccount of the training pods"
    ),  # fmt: skip
)

#: Parameters a compiled remote pipeline (KFP, Vertex AI) does not offer: ``backend=local`` runs pods as
#: processes on the machine that runs the steps, which a remote run does not have; the profile's value is kept.
LOCAL_ONLY: frozenset[str] = frozenset({"backend"})


def remote_run_sets(path: str) -> bool:
    """Whether a run of the compiled remote pipeline (KFP, Vertex AI) can set the spec field at dotted ``path`` from
    its run form: a :data:`RUN_PARAMETERS` entry not in :data:`LOCAL_ONLY`. E.g. ``launcher``: the RBAC rendered for
    a profile then covers every launcher (:func:`multislice.render.launchers.offered_kinds`)."""
    return any(p.path == path and p.name not in LOCAL_ONLY for p in RUN_PARAMETERS)


#: Per-stage parameters, named ``stage<N>_<field>`` with N counting from 1.
STAGE_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("steps", int, "Training steps"),
    ("per_device_batch_size", float, "Sequences per chip per step"),
)

_STAGE_PARAM = re.compile(r"^stage(?P<n>[1-9][0-9]*)_(?P<field>[a-z_]+)$")
_BY_NAME = {p.name: p for p in RUN_PARAMETERS}


def stage_parameter_name(index: int, field: str) -> str:
    """Name of a stage's parameter, e.g. ``stage1_steps`` for index 0."""
    return f"stage{index + 1}_{field}"


def path_for(key: str) -> str:
    """Dotted spec path for a parameter name; other keys are taken as paths already."""
    if key in _BY_NAME:
        return _BY_NAME[key].path
    match = _STAGE_PARAM.fullmatch(key)
    if match and match.group("field") in {f for f, _, _ in STAGE_FIELDS}:
        return f"stages.{int(match.group('n')) - 1}.{match.group('field')}"
    return key


def parameter_values(spec: RunSpec, remote: bool = False) -> dict[str, tuple[type, Any]]:
    """Every pipeline parameter of a spec, in order: name -> (type, the spec's value; '' for an unset optional one).

    ``remote``: for a pipeline compiled for KFP or Vertex AI, without :data:`LOCAL_ONLY`.
    """
    values = {
        p.name: (p.type, _parameter_value(p, _get(spec, p.path)))
        for p in RUN_PARAMETERS
        if not (remote and p.name in LOCAL_ONLY)
    }
    for index, stage in enumerate(spec.stages):
        for field, kind, _ in STAGE_FIELDS:
            values[stage_parameter_name(index, field)] = (kind, kind(getattr(stage, field)))
    return values


def descriptions(spec: RunSpec, remote: bool = False) -> dict[str, str]:
    """Every pipeline parameter's run-form description, by name (same order as :func:`parameter_values`)."""
    text = {p.name: p.description for p in RUN_PARAMETERS}
    for index, stage in enumerate(spec.stages):
        for field, _, description in STAGE_FIELDS:
            text[stage_parameter_name(index, field)] = f"Stage {index + 1} ({stage.name}): {description}"
    return {name: text[name] for name in parameter_values(spec, remote)}


_TYPE_WORDS = {int: "int", float: "float", bool: "bool", str: "str"}


def help_lines(spec: RunSpec | None, width: int = 78) -> list[str]:
    """Every run parameter as ``multislice run --help`` lists it: ``name=<the spec's value> (type)``, then its
    description indented; without a spec (a profile that does not load), the stage parameters of stage 1 and
    no values. Generated from :data:`RUN_PARAMETERS` and :data:`STAGE_FIELDS`, so the list cannot drift."""
    if spec is not None:
        values = {name: value for name, (_, value) in parameter_values(spec).items()}
        text = descriptions(spec)
    else:
        values = {}
        text = {p.name: p.description for p in RUN_PARAMETERS}
        text |= {stage_parameter_name(0, f): f"Stage 1: {d}" for f, _, d in STAGE_FIELDS}
    kinds = {p.name: p.type for p in RUN_PARAMETERS}
    for name in text:
        match = _STAGE_PARAM.fullmatch(name)
        if match:
            kinds[name] = next(kind for field, kind, _ in STAGE_FIELDS if field == match.group("field"))
    lines = []
    for name, description in text.items():
        value = values.get(name)
        shown = "" if name not in values else ("''" if value == "" else str(value).lower() if isinstance(value, bool)
                                                else str(value))  # fmt: skip
        notes = [_TYPE_WORDS[kinds[name]]]
        if path_for(name) != name:
            notes.append(f"sets {path_for(name)}")
        if name in _BY_NAME and _BY_NAME[name].optional:
            notes.append("'' for none")
        lines.append(f"  {name}{'=' + shown if values else ''} ({'; '.join(notes)})")
        lines += textwrap.wrap(description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def as_override(key: str, value: Any) -> Any:
    """A parameter's value as a spec override: ``''`` for an optional parameter means unset (None)."""
    parameter = _BY_NAME.get(key)
    if parameter is not None and parameter.optional and value == "":
        return None
    return value


def _parameter_value(parameter: Parameter, value: Any) -> Any:
    if value is None and parameter.optional:
        return ""
    return parameter.type(value)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class FieldKind:
    """What a run spec field holds, as far as reading a ``--set`` value needs: text, and whether it may be unset."""

    string: bool
    optional: bool


def field_kind(path: str) -> FieldKind | None:
    """The kind of the run spec field at dotted ``path`` (stages by index or name), or None when unknown.

    Read from the pydantic models' annotations (:mod:`multislice.config.models`).
    """
    model: Any = RunSpec
    parts = path.split(".")
    index = 0
    annotation: Any = None
    while index < len(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(parts[index])
        if field is None:
            return None
        annotation = field.annotation
        index += 1
        if parts[index - 1] in ("stages", "example_stages"):
            if index == len(parts):
                return None
            index += 1  # the stage's index or name
            model = Stage
            continue
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        model = (
            args[0]
            if len(args) == 1 and typing.get_origin(annotation) in (typing.Union, types.UnionType)
            else annotation
        )
    args = typing.get_args(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    optional = union and type(None) in args
    string = annotation is str or (union and set(args) <= {str, type(None)})
    return FieldKind(string=string, optional=optional)
