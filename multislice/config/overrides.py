"""Overrides: ``--set key=value`` on the CLI and pipeline parameters, applied to a profile's data."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from multislice.config import parameters
from multislice.errors import ConfigError


def parse_set_arguments(pairs: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings (CLI ``--set``); values are YAML scalars or lists.

    Raises:
        ConfigError: a pair without ``=``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError([("--set", f"{pair!r} is not key=value, e.g. --set run_name=my-run")])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dict,)) or value is None:
            value = raw
        out[key.strip()] = value
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with overrides applied.

    Keys are either pipeline parameter names (``run_name``, ``num_slices``,
    ``trainer_image``, ``stage1_steps``; see :mod:`multislice.config.parameters`) or
    dotted paths into the spec (``images.trainer``, ``stages.0.steps``,
    ``stages.tiny-8b-recipe.ici.fsdp``; a stage may be named by index or name).

    Raises:
        ConfigError: a path that leads nowhere (unknown stage, or a non-mapping on the way).
    """
    result = copy.deepcopy(dict(data))
    issues: list[tuple[str, str]] = []
    for key, value in overrides.items():
        path = parameters.path_for(key)
        parts = path.split(".")
        node: Any = result
        ok = True
        for depth, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                index = _stage_index(node, part)
                if index is None:
                    known = ", ".join(str(s.get("name")) for s in node if isinstance(s, Mapping))
                    issues.append((key, f"no stage {part!r} (by index from 0 or by name: {known})"))
                    ok = False
                    break
                node = node[index]
            elif isinstance(node, dict):
                if part not in node or node[part] is None:
                    node[part] = {}
                node = node[part]
            else:
                issues.append((key, f"{'.'.join(parts[:depth])} is not a mapping, so {part!r} cannot be set in it"))
                ok = False
                break
        if not ok:
            continue
        if isinstance(node, dict):
            node[parts[-1]] = value
        else:
            issues.append((key, f"{'.'.join(parts[:-1])} is not a mapping"))
    if issues:
        raise ConfigError(issues)
    return result


def _stage_index(stages: list[Any], part: str) -> int | None:
    if part.isdigit():
        index = int(part)
        return index if index < len(stages) else None
    for index, stage in enumerate(stages):
        if isinstance(stage, Mapping) and stage.get("name") == part:
            return index
    return None
