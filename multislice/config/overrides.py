"""Overrides: ``--set key=value`` on the CLI and pipeline parameters, applied to a profile's data."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from multislice.config import parameters, yaml_input
from multislice.errors import ConfigError


def parse_set_arguments(pairs: list[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings (CLI ``--set``); values are YAML scalars or lists.

    Where the key names a string field (``output_dir``, ``images.trainer``, ``stages.0.name``...), the
    value is taken as written (``output_dir=2024-01-01`` stays a string, not a YAML date). A value YAML
    reads as a date is kept as written too. ``null`` (or ``~``) unsets an optional field. A mapping
    (``stages.0.data={kind: text}``) is refused: one ``--set`` sets one field, so the fix names the
    dotted keys that set its fields (``stages.0.data.kind=text``).

    Raises:
        ConfigError: a pair without ``=``, ``null`` for a field that needs a value, a mapping value, or a value
            whose YAML aliases expand past :data:`yaml_input.MAX_VALUES` values or hold their own anchor
            (:func:`yaml_input.load`, checked before the value is built).
    """
    out: dict[str, Any] = {}
    issues: list[tuple[str, str]] = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError([("--set", f"{pair!r} is not key=value, e.g. --set run_name=my-run")])
        kind = parameters.field_kind(parameters.path_for(key))
        try:
            value = yaml_input.load(raw) if raw.strip() else ""
        except yaml_input.AliasExpansionError as error:
            if kind is None or not kind.string:  # a text field takes the value as written, aliases unread
                issues.append((key, f"--set {key}=...: the value is refused before it is read: {error.reason}"))
                continue
            value = raw
        except (yaml.YAMLError, ValueError, OverflowError, RecursionError):
            value = raw
        if value is None:
            if kind is not None and not kind.optional:
                issues.append((key, f"--set {key}={raw}: {key} cannot be null; give a value"))
                continue
            if kind is None:
                value = raw
        elif (kind is not None and kind.string) or isinstance(value, datetime.date):
            value = raw
        elif isinstance(value, dict):
            issues.append((key, _mapping_message(key, raw, value)))
            continue
        out[key] = value
    if issues:
        raise ConfigError(issues)
    return out


def _mapping_message(key: str, raw: str, value: dict[Any, Any]) -> str:
    """The refusal of a mapping given to ``--set KEY=``: its fields as dotted ``--set`` keys."""

    def flat(prefix: str, node: Any) -> list[str]:
        if isinstance(node, dict) and node:
            return [item for k, v in node.items() for item in flat(f"{prefix}.{k}", v)]
        shown = "" if node is None else node if isinstance(node, str) else yaml.safe_dump(node, default_flow_style=True)
        return [f"{prefix}={str(shown).strip().removesuffix('...').strip()}"]

    dotted = flat(key, value)[:6]
    shown = raw if len(raw) <= 60 else raw[:57] + "..."
    return (
        f"--set {key}={shown}: a mapping cannot be given to one --set; set each field with a dotted key: "
        + " ".join(f"--set {pair}" for pair in dotted)
    )


def _unshared(value: Any) -> Any:
    """A deep copy in which no mapping or list is shared: a YAML alias (``maxtext_overrides: *local_maxtext``)
    loads as one object in two places, which ``copy.deepcopy`` keeps shared (its memo), so setting one
    stage's key would set the other's too."""
    if isinstance(value, Mapping):
        return {key: _unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unshared(item) for item in value]
    return copy.deepcopy(value)


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with overrides applied.

    Keys are either pipeline parameter names (``run_name``, ``num_slices``,
    ``trainer_image``, ``stage1_steps``; see :mod:`multislice.config.parameters`) or
    dotted paths into the spec (``images.trainer``, ``stages.0.steps``,
    ``stages.tiny-8b-recipe.ici.fsdp``; a stage may be named by index or name).

    A stage whose ``steps`` is overridden below its ``checkpoint_period``, the period itself not
    overridden, gets ``checkpoint_period = steps`` (:func:`followed_checkpoint_periods`), so a short run
    (``--set stage1_steps=4``) needs no second setting; an overridden period stays as given and is checked.

    Raises:
        ConfigError: a path that leads nowhere (unknown stage, or a non-mapping on the way).
    """
    return _apply(data, overrides)[0]


@dataclass(frozen=True)
class FollowedPeriod:
    """A stage's ``checkpoint_period`` lowered to its overridden ``steps`` (:func:`apply_overrides`).

    Attributes:
        index: The stage's index in ``stages``, from 0.
        stage: The stage's name.
        steps: Its steps, as overridden.
        profile_period: The checkpoint period the profile gave, steps.
    """

    index: int
    stage: str
    steps: int
    profile_period: int

    def describe(self) -> str:
        """In words, for the plan and the CLI (``stage 1 tiny: checkpoint_period follows steps ...``)."""
        return (
            f"stage {self.index + 1} {self.stage}: checkpoint_period follows steps={self.steps} "
            f"(the profile's {self.profile_period} exceeds it; set stages.{self.index}.checkpoint_period to choose)"
        )


def followed_checkpoint_periods(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> list[FollowedPeriod]:
    """The stages whose ``checkpoint_period`` :func:`apply_overrides` lowers to their overridden ``steps``.

    Raises:
        ConfigError: as :func:`apply_overrides`.
    """
    return _apply(data, overrides)[1]


def _apply(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[dict[str, Any], list[FollowedPeriod]]:
    result = _unshared(dict(data))
    issues: list[tuple[str, str]] = []
    steps_set: set[int] = set()
    period_set: set[int] = set()
    for key, value in overrides.items():
        value = parameters.as_override(key, value)
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
            if len(parts) == 3 and parts[0] == "stages" and parts[2] in ("steps", "checkpoint_period"):
                index = _stage_index(result.get("stages") or [], parts[1])
                if index is not None:
                    (steps_set if parts[2] == "steps" else period_set).add(index)
        else:
            issues.append((key, f"{'.'.join(parts[:-1])} is not a mapping"))
    if issues:
        raise ConfigError(issues)
    followed = []
    for index in sorted(steps_set - period_set):
        stage = result["stages"][index]
        steps, period = stage.get("steps"), stage.get("checkpoint_period")
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, period))
        if whole and 0 < steps < period:
            stage["checkpoint_period"] = steps
            followed.append(FollowedPeriod(index, str(stage.get("name", index)), steps, period))
    return result, followed


def _stage_index(stages: list[Any], part: str) -> int | None:
    if part.isdigit():
        index = int(part)
        return index if index < len(stages) else None
    for index, stage in enumerate(stages):
        if isinstance(stage, Mapping) and stage.get("name") == part:
            return index
    return None
