"""Profiles: reading ``configs/<profile>.yaml``, applying overrides and model presets, validating a :class:`RunSpec`.

A stage's ``model`` may name a preset, as MaxText's ``configs/models/<name>.yml``
does for its models: ``model: {preset: llama3-tiny, num_decoder_layers: 4}``
takes ``configs/models/llama3-tiny.yaml`` and the given keys on top. Presets
are expanded when the spec is loaded, so the spec (and the compiled pipeline
that embeds it) holds the full dims and needs no preset file at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from multislice.config.checks import cross_field_issues
from multislice.config.models import RunSpec
from multislice.config.overrides import apply_overrides
from multislice.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: Where ``--profile NAME`` looks for ``NAME.yaml``.
PROFILES_DIR = PROJECT_ROOT / "configs"
#: Where a stage's ``model: {preset: NAME}`` looks for ``NAME.yaml``.
PRESETS_DIR = PROFILES_DIR / "models"


def known_presets() -> list[str]:
    """Names of the model presets in :data:`PRESETS_DIR`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def expand_presets(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of profile data whose stages' ``model: {preset: NAME, ...}`` hold the preset's keys, the given on top.

    Raises:
        ConfigError: an unknown preset (naming the known ones), or a preset file that is not a mapping.
    """
    result = dict(data)
    issues: list[tuple[str, str]] = []
    for key in ("stages", "example_stages"):
        stages = data.get(key)
        if not isinstance(stages, list):
            continue
        result[key] = []
        for index, stage in enumerate(stages):
            model = stage.get("model") if isinstance(stage, Mapping) else None
            if not isinstance(model, Mapping) or "preset" not in model:
                result[key].append(stage)
                continue
            where = f"{key}[{index}] ({stage.get('name', '')}).model.preset"
            name = str(model["preset"])
            path = PRESETS_DIR / f"{name}.yaml"
            if not path.is_file():
                issues.append((where, f"no model preset {name!r}; known presets: {', '.join(known_presets())}"))
                result[key].append(stage)
                continue
            preset = yaml.safe_load(path.read_text(encoding="utf-8"))
            if not isinstance(preset, Mapping):
                issues.append((where, f"{path} does not hold a mapping of model fields"))
                result[key].append(stage)
                continue
            given = {k: v for k, v in model.items() if k != "preset"}
            result[key].append({**stage, "model": {**preset, **given}})
    if issues:
        raise ConfigError(issues)
    return result


def _format_loc(loc: tuple[Any, ...], data: Mapping[str, Any]) -> str:
    out = ""
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            name = ""
            if isinstance(node, (list, tuple)) and part < len(node) and isinstance(node[part], Mapping):
                name = node[part].get("name", "")
            out += f"[{part}]" + (f" ({name})" if name else "")
            node = node[part] if isinstance(node, (list, tuple)) and part < len(node) else None
        else:
            out += ("." if out else "") + str(part)
            node = node.get(part) if isinstance(node, Mapping) else None
    return out


def _pydantic_issues(error: ValidationError, data: Mapping[str, Any]) -> list[tuple[str, str]]:
    issues = []
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field; check its spelling (the fields are in multislice/config/models.py)"
        elif err["type"] == "missing":
            message = "required field is missing"
        issues.append((_format_loc(loc, data), message))
    return issues


def load_spec(data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """Validate a run spec given as plain data (a parsed profile), after overrides and model presets.

    Args:
        data: The profile's content.
        overrides: ``{key: value}`` as for :func:`apply_overrides`.

    Returns:
        The validated RunSpec.

    Raises:
        ConfigError: listing every bad field with its fix. Nothing is created.
    """
    merged = expand_presets(apply_overrides(data, overrides or {}))
    try:
        spec = RunSpec.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_pydantic_issues(error, merged)) from None
    issues = cross_field_issues(spec)
    if issues:
        raise ConfigError(issues)
    return spec


def profile_path(profile: str) -> Path:
    """Resolve a profile name (``local``) or a path to a YAML file.

    Raises:
        ConfigError: no such profile; the message lists those in ``configs/``.
    """
    candidate = Path(profile)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    named = PROFILES_DIR / f"{profile}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
    raise ConfigError(
        [("profile", f"no profile {profile!r}; known profiles: {', '.join(known)}, or a path to a .yaml file")]
    )


def read_profile(profile: str) -> dict[str, Any]:
    """The raw content of a profile (not yet validated)."""
    with open(profile_path(profile), encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ConfigError([("profile", f"{profile_path(profile)} does not hold a mapping")])
    return data


def load_profile(profile: str, overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """Read, override and validate a profile. Raises ConfigError."""
    return load_spec(read_profile(profile), overrides)


def spec_to_data(spec: RunSpec) -> dict[str, Any]:
    """Plain data (JSON-able) for a spec; ``load_spec(spec_to_data(s)) == s``."""
    return spec.model_dump(mode="json", exclude_none=True)
