"""Profiles: reading ``configs/<profile>.yaml``, applying overrides, validating into a :class:`RunSpec`."""

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
            message = "unknown field; check its spelling against the README's config reference"
        elif err["type"] == "missing":
            message = "required field is missing"
        issues.append((_format_loc(loc, data), message))
    return issues


def load_spec(data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """Validate a run spec given as plain data (a parsed profile), after overrides.

    Args:
        data: The profile's content.
        overrides: ``{key: value}`` as for :func:`apply_overrides`.

    Returns:
        The validated RunSpec.

    Raises:
        ConfigError: listing every bad field with its fix. Nothing is created.
    """
    merged = apply_overrides(data, overrides or {})
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
