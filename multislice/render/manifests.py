"""Validation of rendered manifests as the API server would do it, and their YAML text.

:func:`object_problems` checks one object: CRD kinds against the CRDs in ``multislice/crds/``
(:mod:`multislice.render.schema`), built-in kinds with the official client's models. Every manifest of a plan,
validated (``multislice render``'s files), is :mod:`multislice.backends.manifests`: it holds GKE's objects too.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import yaml

from multislice.render import ray, rbac, schema


def _read_as_model(obj: dict[str, Any], model: str) -> None:
    """Read ``obj`` into the ``kubernetes.client`` model named ``model`` (e.g. ``V1Job``).

    ``ApiClient.deserialize`` is the client's public way in: it takes a response whose ``data`` is JSON
    (kubernetes/client/api_client.py).

    Raises:
        ValueError: a required field is missing or a value is not allowed (the model's setters).
        TypeError: a value has the wrong type, or ``obj`` is not JSON.
    """
    from kubernetes import client  # as its callers: the client only when a built-in Job kind is checked

    client.ApiClient().deserialize(SimpleNamespace(data=json.dumps(obj)), model)


def object_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject ``obj``: CRD kinds against their CRD, built-in kinds by :mod:`rbac`
    (RBAC) or :mod:`ray` (DRA ResourceClaimTemplates)."""
    if (obj.get("apiVersion"), obj.get("kind")) == (ray.CLAIM_API_VERSION, "ResourceClaimTemplate"):
        return ray.claim_template_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) == ("batch/v1", "CronJob"):
        return schema.builtin_problems(obj) + cronjob_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) == ("batch/v1", "Job"):
        return schema.builtin_problems(obj) + job_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) in schema.BUILTIN_KINDS:
        return rbac.problems(obj)
    return schema.problems(obj)


def cronjob_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ``batch/v1`` CronJob's spec; empty when valid.

    Read into the official client's ``V1CronJob`` model, whose setters refuse a missing required field
    (``schedule``, ``jobTemplate``, a container's ``name``) as the API's OpenAPI schema marks them; unknown
    fields are refused by name (the model would drop them silently).
    """
    from kubernetes import client

    found: list[str] = []
    if set(obj.get("spec", {})) - set(client.V1CronJobSpec.attribute_map.values()):
        found.append(
            f"spec: unknown fields {sorted(set(obj['spec']) - set(client.V1CronJobSpec.attribute_map.values()))}"
        )
    try:
        _read_as_model(obj, "V1CronJob")  # the client's own model check
    except (ValueError, TypeError) as error:
        found.append(f"spec: {error}")
    return found


def job_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ``batch/v1`` Job (the export Job); empty when valid.

    Read into the official client's ``V1Job`` model, whose setters refuse a missing required field (a container's
    ``name``, a volume's ``name``, an env var's ``name``) as the API's OpenAPI schema marks them; unknown fields of the
    Job, pod and container specs are refused by name (the model would drop them silently); every resource quantity
    must parse (``kubernetes.utils.parse_quantity``, the API's ``resource.Quantity`` grammar); limits may not be
    below requests (the API server's ``ValidateResourceRequirements``).
    """
    from kubernetes import client, utils

    found: list[str] = []
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    for where, given, model in (
        ("spec", spec, client.V1JobSpec),
        ("spec.template.spec", pod, client.V1PodSpec),
        *(
            (f"spec.template.spec.containers[{i}]", c, client.V1Container)
            for i, c in enumerate(pod.get("containers", []))
        ),
    ):
        unknown = sorted(set(given) - set(model.attribute_map.values()))
        if unknown:
            found.append(f"{where}: unknown fields {unknown}")
    for i, container in enumerate(pod.get("containers", [])):
        limits = container.get("resources", {}).get("limits", {})
        requests = container.get("resources", {}).get("requests", {})
        for kind, values in (("requests", requests), ("limits", limits)):
            for name, value in values.items():
                try:
                    utils.parse_quantity(value)
                except ValueError:
                    found.append(f"spec.template.spec.containers[{i}].resources.{kind}.{name}: {value!r} is not a "
                                 "quantity")  # fmt: skip
        for name in set(limits) & set(requests):
            try:
                if utils.parse_quantity(limits[name]) < utils.parse_quantity(requests[name]):
                    found.append(f"spec.template.spec.containers[{i}].resources: {name} limit below its request")
            except ValueError:
                pass
    if pod.get("restartPolicy") not in ("Never", "OnFailure"):
        found.append("spec.template.spec.restartPolicy: a Job's pods restart Never or OnFailure")
    try:
        _read_as_model(obj, "V1Job")  # the client's own model check
    except (ValueError, TypeError) as error:
        found.append(f"spec: {error}")
    return found


def to_yaml(obj: dict[str, Any]) -> str:
    """YAML text of one object, keys in rendering order (libyaml's safe dumper when present: same text, faster)."""
    return yaml.dump(obj, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, width=120)
