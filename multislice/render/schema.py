"""Validate rendered objects against the upstream CRDs, as an API server would on create.

The CRDs (JobSet v0.12.0, Kueue v0.19.2) ship in ``multislice/crds/``,
copied unchanged from the upstream repositories. For an object we find its
CRD by ``apiVersion`` and ``kind``, take ``spec.versions[].schema.openAPIV3Schema``
and check:

1. the structural schema with ``jsonschema`` (OpenAPI v3 is JSON Schema draft 4
   plus Kubernetes extensions): ``x-kubernetes-int-or-string`` becomes
   integer-or-string, and, as ``kubectl --validate=strict`` does, a field the
   schema does not declare is an error rather than silently pruned;
2. the CEL rules in ``x-kubernetes-validations`` with ``cel-python``, except
   transition rules (those using ``oldSelf``), which only apply to updates;
3. ObjectMeta, which the CRD schema leaves to the API server: name format,
   namespace for namespaced kinds, label keys and values.

Defaulting webhooks (JobSet fills failure-policy rule names, for example) do
not run here, so renderers must write those fields themselves.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from multislice import names
from multislice.errors import InputError

if TYPE_CHECKING:
    import celpy
    import jsonschema

CRDS_DIR = Path(__file__).resolve().parents[1] / "crds"

_LABEL_KEY_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class ManifestInvalid(InputError, ValueError):
    """A rendered object does not validate; ``problems`` lists ``path: message`` strings."""

    def __init__(self, obj: dict[str, Any], problems: list[str]):
        self.problems = problems
        kind = obj.get("kind", "?")
        name = obj.get("metadata", {}).get("name", "?")
        super().__init__(
            f"{kind} {name!r} does not validate against its CRD:\n" + "\n".join(f"  - {p}" for p in problems)
        )


@dataclass(frozen=True)
class CrdVersion:
    """One served version of a CRD: its schema and scope."""

    group: str
    version: str
    kind: str
    namespaced: bool
    schema: dict[str, Any]
    source: str


@functools.cache
def _crd_file(path: Path, crds_dir: Path) -> dict[tuple[str, str], CrdVersion]:
    """The served CRD versions of one file, keyed by ``(apiVersion, kind)``.

    The CRD files are several MB of YAML: they are parsed with libyaml's safe
    loader where PyYAML has it (about 10x faster than the pure-Python one).
    """
    index: dict[tuple[str, str], CrdVersion] = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=loader):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            if not version.get("served", False):
                continue
            api_version = f"{spec['group']}/{version['name']}"
            index[(api_version, spec["names"]["kind"])] = CrdVersion(
                group=spec["group"],
                version=version["name"],
                kind=spec["names"]["kind"],
                namespaced=spec["scope"] == "Namespaced",
                schema=version["schema"]["openAPIV3Schema"],
                source=str(path.relative_to(crds_dir)),
            )
    return index


@functools.cache
def crd_index(crds_dir: Path = CRDS_DIR) -> dict[tuple[str, str], CrdVersion]:
    """All served CRD versions under ``crds_dir``, keyed by ``(apiVersion, kind)`` (every file parsed)."""
    index: dict[tuple[str, str], CrdVersion] = {}
    for path in sorted(crds_dir.rglob("*.yaml")):
        index.update(_crd_file(path, crds_dir))
    return index


@functools.cache
def crd(api_version: str, kind: str, crds_dir: Path = CRDS_DIR) -> CrdVersion:
    """The CRD version that serves ``apiVersion`` and ``kind``, parsing only its group's files where it can.

    Upstream CRD files are named ``<group>_<plural>.yaml`` (controller-gen's naming, as JobSet, Kueue and
    KubeRay ship them), so a JobSet needs the 0.8 MB of ``jobset.x-k8s.io_jobsets.yaml`` parsed, not the 4.7 MB of
    every CRD (about 1.3 s of a pipeline step's CPU on this machine). A kind not found there is looked up in all.

    Raises:
        KeyError: no served CRD for them, with the known ones.
    """
    key = (api_version, kind)
    group = api_version.rpartition("/")[0]
    for path in sorted(crds_dir.rglob(f"{group}_*.yaml")) if group else ():
        found = _crd_file(path, crds_dir).get(key)
        if found is not None:
            return found
    index = crd_index(crds_dir)
    if key not in index:
        known = ", ".join(f"{a} {k}" for a, k in sorted(index))
        raise KeyError(f"no served CRD for {api_version} {kind}; known: {known}")
    return index[key]


def _structural(schema: Any) -> Any:
    """Translate Kubernetes' OpenAPI extensions into plain JSON Schema (strict about unknown fields)."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):
        # Go's RE2 (the API server's) takes a flag group after ``^``; Python's re needs global flags first
        # (Kueue's AdmissionCheck parameters.kind: ``^(?i)[a-z]([-a-z0-9]*[a-z0-9])?$``).
        out["pattern"] = "(?i)^" + pattern[len("^(?i)") :]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator(api_version: str, kind: str, crds_dir: Path = CRDS_DIR) -> jsonschema.Draft4Validator:
    import jsonschema  # 0.3 s: only validating loads it, not every process that imports this module (supervisors)

    schema = _structural(copy.deepcopy(crd(api_version, kind, crds_dir).schema))
    # ObjectMeta is checked by _metadata_problems, as the API server does it.
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _cel_rules(schema: dict[str, Any], obj: Any, path: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Yield ``(path, rule, value)`` for every CEL rule that applies to a present value."""
    for rule in schema.get("x-kubernetes-validations", ()):
        yield path, rule, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in schema.get("properties", {}):
                yield from _cel_rules(schema["properties"][key], value, f"{path}.{key}" if path else key)
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from _cel_rules(schema["additionalProperties"], value, f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            yield from _cel_rules(schema["items"], value, f"{path}[{i}]")


@functools.cache
def _cel_program(rule: str) -> celpy.Runner:
    import celpy  # 0.6 s (lark, pendulum): only evaluating a CEL rule loads it, not every importer of this module

    env = celpy.Environment()
    return env.program(env.compile(rule))


@dataclass
class CelReport:
    """What CEL evaluation did for one object.

    Attributes:
        evaluated: Rules evaluated, as ``path: rule``.
        skipped: Transition rules (``oldSelf``), which apply only to updates.
        problems: Rules that failed (``path: message``) or could not be evaluated.
    """

    evaluated: list[str]
    skipped: list[str]
    problems: list[str]


def check_cel(obj: dict[str, Any], crds_dir: Path = CRDS_DIR) -> CelReport:
    """Evaluate the CRD's CEL rules on ``obj`` as a create request would."""
    from celpy.adapter import json_to_cel  # with celpy (see _cel_program): loaded where CEL is evaluated

    served = crd(obj["apiVersion"], obj["kind"], crds_dir)
    report = CelReport([], [], [])
    for path, rule, value in _cel_rules(served.schema, obj, ""):
        text = rule["rule"]
        where = path or "<root>"
        if re.search(r"\boldSelf\b", text):
            report.skipped.append(f"{where}: {text}")
            continue
        try:
            result = _cel_program(text).evaluate({"self": json_to_cel(value)})
        except Exception as error:  # noqa: BLE001 - any evaluator failure must surface, not pass
            report.problems.append(f"{where}: CEL rule {text!r} could not be evaluated ({error})")
            continue
        report.evaluated.append(f"{where}: {text}")
        if isinstance(result, Exception) or not bool(result):
            report.problems.append(f"{where}: {rule.get('message') or 'failed CEL rule ' + repr(text)}")
    return report


def _label_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and (not names.DNS1123_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253):
        return f"label key {key!r}: prefix must be a DNS-1123 subdomain"
    if not name or len(name) > 63 or not _LABEL_KEY_NAME.fullmatch(name):
        return f"label key {key!r}: name part must be 1-63 alphanumeric, '-', '_' or '.' characters"
    return None


def _metadata_problems(obj: dict[str, Any], namespaced: bool) -> list[str]:
    problems = []
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return ["metadata: missing"]
    name = meta.get("name", "")
    if not names.DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        problems.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    if obj.get("kind") == "JobSet" and not (names.DNS1035_LABEL.fullmatch(name) and len(name) <= 63):
        problems.append(f"metadata.name: JobSet name {name!r} must be a DNS-1035 label (it names a Service)")
    if namespaced and not meta.get("namespace"):
        problems.append("metadata.namespace: a namespaced object needs a namespace")
    if not namespaced and "namespace" in meta:
        problems.append("metadata.namespace: a cluster-scoped object has no namespace")
    for key, value in (meta.get("labels") or {}).items():
        if problem := _label_key_problem(key):
            problems.append(f"metadata.labels: {problem}")
        if not isinstance(value, str) or len(value) > 63 or not names.LABEL_VALUE.fullmatch(value):
            problems.append(f"metadata.labels[{key}]: {value!r} is not a valid label value")
    for key, value in (meta.get("annotations") or {}).items():
        if problem := _label_key_problem(key):
            problems.append(f"metadata.annotations: {problem.replace('label key', 'annotation key')}")
        if not isinstance(value, str):
            problems.append(f"metadata.annotations[{key}]: values must be strings")
    return problems


#: Built-in kinds this project renders (RBAC, DRA), which have no CRD: ``(apiVersion, kind)`` -> namespaced.
BUILTIN_KINDS: dict[tuple[str, str], bool] = {
    ("v1", "ServiceAccount"): True,
    ("rbac.authorization.k8s.io/v1", "Role"): True,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): True,
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): False,
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): False,
    # DRANET claims of the Ray launcher (multislice.render.ray).
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): True,
    # The reaper of cancelled runs' JobSets (multislice.backends.gke.lease.reaper_cronjob).
    ("batch/v1", "CronJob"): True,
    # The Hugging Face export of a stage (multislice.backends.gke.exporter.render_job).
    ("batch/v1", "Job"): True,
    # What limits JobSet's in-place restart agent to its pod annotation (multislice.render.in_place).
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): False,
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): False,
}


def builtin_problems(obj: dict[str, Any]) -> list[str]:
    """ObjectMeta problems of a built-in kind (:data:`BUILTIN_KINDS`), as the API server checks them.

    Only ObjectMeta: the kind's own fields are checked by its renderer (e.g. :func:`multislice.render.rbac.problems`).

    Raises:
        KeyError: ``obj`` is not one of :data:`BUILTIN_KINDS`.
    """
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    if key not in BUILTIN_KINDS:
        raise KeyError(f"{key[0]} {key[1]} is not a built-in kind this project renders: {sorted(BUILTIN_KINDS)}")
    return _metadata_problems(obj, BUILTIN_KINDS[key])


def problems(obj: dict[str, Any], crds_dir: Path = CRDS_DIR) -> list[str]:
    """Every reason the API server would reject ``obj`` on create; empty when valid.

    Args:
        obj: The object as plain data.
        crds_dir: Directory of CRD YAML files (default: the copies shipped in ``multislice/crds``).

    Raises:
        KeyError: no CRD for the object's ``apiVersion`` and ``kind``.
    """
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    served = crd(*key, crds_dir)
    validator = _validator(*key, crds_dir)
    found = [
        f"{_path(error.absolute_path)}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
    found += _metadata_problems(obj, served.namespaced)
    found += check_cel(obj, crds_dir).problems
    return found


def validate(obj: dict[str, Any]) -> None:
    """Raise :class:`ManifestInvalid` unless ``obj`` validates against its CRD."""
    found = problems(obj)
    if found:
        raise ManifestInvalid(obj, found)
