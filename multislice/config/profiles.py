"""Profiles: reading ``configs/<profile>.yaml``, applying overrides and model presets, validating a :class:`RunSpec`.

A stage's ``model`` may name a preset, as MaxText's ``configs/models/<name>.yml``
does for its models: ``model: {preset: llama3-tiny, num_decoder_layers: 4}``
takes ``configs/models/llama3-tiny.yaml`` and the given keys on top. Presets
are expanded when the spec is loaded, so the spec (and the compiled pipeline
that embeds it) holds the full dims and needs no preset file at run time.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from multislice.config import parameters, yaml_input
from multislice.config.checks import cross_field_issues
from multislice.config.models import RunSpec
from multislice.config.overrides import apply_overrides
from multislice.config.values import expansion_issues
from multislice.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: Where ``--profile NAME`` looks for ``NAME.yaml``.
#: The profiles: ``configs/`` of a source checkout, else the copy packaged with the library
#: (``multislice/profiles``, a link to ``configs/`` in the checkout, real files in a wheel), so that an
#: installed package (a notebook's ``pip install``) finds them without a checkout.
PACKAGED_PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
PROFILES_DIR = PROJECT_ROOT / "configs" if (PROJECT_ROOT / "configs").is_dir() else PACKAGED_PROFILES_DIR
#: Where a stage's ``model: {preset: NAME}`` looks for ``NAME.yaml``.
PRESETS_DIR = PROFILES_DIR / "models"
#: Largest profile (or model preset) file read, bytes: larger ones are refused before parsing, so a
#: mistaken or hostile file cannot hold the CLI for minutes (a real profile is a few KiB).
MAX_PROFILE_BYTES = 1024 * 1024


def _where(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def parse_yaml_mapping(text: bytes | str, source: str) -> dict[str, Any]:
    """Parse one YAML document holding a mapping with PyYAML's safe loader (no Python tags).

    Args:
        text: The file's bytes (UTF-8) or text.
        source: What to name in errors (the file's path).

    Raises:
        ConfigError: naming ``source`` and, for a syntax error, the line: text over
            :data:`MAX_PROFILE_BYTES`, not UTF-8, a NUL or other unreadable character, a YAML
            error (tabs, unclosed quotes or brackets, unhashable keys, a ``!!python/...`` tag),
            aliases that expand past :data:`yaml_input.MAX_VALUES` values or hold their own anchor
            (:func:`yaml_input.load_all`, checked before anything is built), several documents, or a
            document that is not a mapping.
    """
    fix = "fix the YAML (see the line named), or give another --profile"
    if len(text) > MAX_PROFILE_BYTES:
        raise ConfigError(
            [("profile", f"{source} is {len(text):,} bytes, over the {MAX_PROFILE_BYTES:,} a profile may have; "
                         "a profile is a few KiB: give the right file")]
        )  # fmt: skip
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(
                [("profile", f"{source} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8")]
            ) from None
    try:
        documents = yaml_input.load_all(text)
    except yaml_input.AliasExpansionError as error:
        raise ConfigError([("profile", f"{source} is refused before it is read: {error.reason}")]) from None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError([("profile", f"{source} is not valid YAML{_where(error)}: {problem}; {fix}")]) from None
    except (ValueError, OverflowError, RecursionError) as error:
        raise ConfigError([("profile", f"{source} holds a value YAML cannot read ({error}); {fix}")]) from None
    documents = [d for d in documents if d is not None] or [None]
    if len(documents) > 1:
        raise ConfigError(
            [("profile", f"{source} holds {len(documents)} YAML documents; a profile is one mapping: remove the '---'")]
        )
    if not isinstance(documents[0], dict):
        raise ConfigError(
            [("profile", f"{source} does not hold a mapping of fields (it holds {type(documents[0]).__name__}); "
                         "a profile is `run_name: ...`, `stages: [...]` and so on")]
        )  # fmt: skip
    return documents[0]


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """:func:`parse_yaml_mapping` of a file, read at most :data:`MAX_PROFILE_BYTES` + 1 bytes.

    Raises:
        ConfigError: as :func:`parse_yaml_mapping`, or the file cannot be read.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PROFILE_BYTES + 1)
            size = os.fstat(handle.fileno()).st_size if len(data) > MAX_PROFILE_BYTES else len(data)
    except OSError as error:
        raise ConfigError([("profile", f"cannot read {path}: {error.strerror}; give a readable YAML file")]) from None
    if len(data) > MAX_PROFILE_BYTES:
        # Only MAX_PROFILE_BYTES + 1 bytes were read: say the file's real size (a pipe's is unknown).
        shown = f"{size:,} bytes" if size > MAX_PROFILE_BYTES else f"over {MAX_PROFILE_BYTES:,} bytes"
        raise ConfigError(
            [("profile", f"{path} is {shown}, over the {MAX_PROFILE_BYTES:,} a profile may have; "
                         "a profile is a few KiB: give the right file")]
        )  # fmt: skip
    return parse_yaml_mapping(data, str(path))


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
            if "/" in name or name.startswith(".") or not path.is_file():
                issues.append((where, f"no model preset {name!r}; known presets: {', '.join(known_presets())}"))
                result[key].append(stage)
                continue
            try:
                preset = read_yaml_mapping(path)
            except ConfigError as error:
                issues.append((where, f"model preset {name!r}: {error.issues[0][1]}"))
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


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``Stage``, ``list[Stage]``, ``Cluster | None``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple, dict, typing.Annotated):
        for arg in typing.get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at ``loc`` in a run spec (list indexes skipped); [] where none is known."""
    model: type[BaseModel] | None = RunSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model else None
        if field is None:
            return []
        model = _model_in(field.annotation)
    return list(model.model_fields) if model else []


def did_you_mean(name: str, known: list[str], prefix: str = "") -> str:
    """`` did you mean <prefix>X?`` for the closest of ``known`` to a misspelt ``name`` (difflib), or ``''``."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f" did you mean {prefix}{close[0]}?" if close else ""


def _pydantic_issues(error: ValidationError, data: Mapping[str, Any]) -> list[tuple[str, str]]:
    issues = []
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            if len(loc) == 1:  # a top-level key: a --set of a pipeline parameter's name too
                stages = data.get("stages")
                stages = stages if isinstance(stages, list) else []
                known += [p.name for p in parameters.RUN_PARAMETERS]
                known += [parameters.stage_parameter_name(i, f) for i in range(len(stages))
                          for f, _, _ in parameters.STAGE_FIELDS]  # fmt: skip
            prefix = "".join(f"{part}." for part in loc[:-1])  # the dotted --set key: stages.0.maxtext_overrides
            hint = did_you_mean(str(loc[-1]), known, prefix) if loc else ""
            message = f"unknown field;{hint or ' check its spelling'} (the fields are in multislice/config/models.py)"
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
    expanded = list(expansion_issues(merged))
    if expanded:
        raise ConfigError(expanded)
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
    if not profile or "\x00" in profile or len(profile) > 4096:
        raise ConfigError([("profile", f"{profile[:80]!r} is not a profile name or path; give e.g. --profile local")])
    candidate = Path(profile)
    try:
        if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
            return candidate
        named = PROFILES_DIR / f"{profile}.yaml"
        if "/" not in profile and named.is_file():
            return named
    except OSError:
        pass
    known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
    hint = did_you_mean(profile, known)
    raise ConfigError(
        [("profile", f"no profile {profile!r};{hint} known profiles: {', '.join(known)}, or a path to a .yaml file")]
    )


def read_profile(profile: str) -> dict[str, Any]:
    """The raw content of a profile (not yet validated).

    Raises:
        ConfigError: no such profile, or a file that is not one YAML mapping (:func:`parse_yaml_mapping`).
    """
    return read_yaml_mapping(profile_path(profile))


def load_profile(profile: str, overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """Read, override and validate a profile. Raises ConfigError."""
    return load_spec(read_profile(profile), overrides)


def spec_to_data(spec: RunSpec) -> dict[str, Any]:
    """Plain data (JSON-able) for a spec; ``load_spec(spec_to_data(s)) == s``."""
    return spec.model_dump(mode="json", exclude_none=True)
