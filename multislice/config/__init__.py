"""The run spec: what a user writes in ``configs/<profile>.yaml`` or changes per run.

Data flows one way: a profile (YAML) plus overrides (``--set key=value`` on the
CLI, or pipeline parameters) -> :func:`load_spec` -> a validated
:class:`RunSpec` -> :mod:`multislice.plan`. Every check runs before anything
is created or started; a failure raises :class:`ConfigError`, whose message
names each bad field and how to fix it.

Modules: :mod:`.models` (the pydantic models and their per-field checks),
:mod:`.checks` (checks across fields), :mod:`.profiles` (profile files, model
presets, loading), :mod:`.overrides` (``--set`` and parameters applied to a
profile), :mod:`.parameters` (the pipeline's parameters and where each lands),
:mod:`.values` (single values: images, GCP names, Cloud Storage paths, output directories),
:mod:`.yaml_input` (user YAML read with its aliases' expansion bounded).
"""

from multislice.config import data, values
from multislice.config.checks import cross_field_issues, export_environment_issues
from multislice.config.models import (
    ZONE,
    AdditionalNodeNetwork,
    ClusterSpec,
    CostSpec,
    ElasticSpec,
    Images,
    ModelSpec,
    NodePoolSpec,
    PreflightSpec,
    RunSpec,
    ServiceAccountsSpec,
    Stage,
    TimeoutsSpec,
)
from multislice.config.overrides import apply_overrides, followed_checkpoint_periods, parse_set_arguments
from multislice.config.profiles import (
    PROFILES_DIR,
    PROJECT_ROOT,
    load_profile,
    load_spec,
    profile_path,
    read_profile,
    spec_to_data,
)
from multislice.errors import ConfigError

__all__ = [
    "ZONE", "AdditionalNodeNetwork", "data", "ClusterSpec", "ConfigError", "CostSpec", "ElasticSpec", "Images",
    "ModelSpec",
    "NodePoolSpec", "PROFILES_DIR", "PROJECT_ROOT", "PreflightSpec", "RunSpec", "ServiceAccountsSpec", "Stage",
    "TimeoutsSpec",
    "apply_overrides", "cross_field_issues", "followed_checkpoint_periods", "export_environment_issues",
    "load_profile", "load_spec",
    "parse_set_arguments", "profile_path",
    "read_profile", "spec_to_data", "values",
]  # fmt: skip
