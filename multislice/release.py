"""Which release of this package a compiled pipeline and an image are: the version and a schema fingerprint.

The compiled pipeline embeds the fully expanded profile, and the image validates
it with the run spec's models (``extra="forbid"``): a YAML compiled by one
release and run in an image of another fails, at best, with an "unknown field".
So ``compile`` writes :func:`current` into the plan tasks' inputs, and the
plan step (:func:`check`) compares it with the image's own before anything
else happens, and fails with one line that names both releases and the fix.

The fingerprint is a hash of the run spec's JSON schema
(:meth:`multislice.config.models.RunSpec.model_json_schema`): two builds of
the same version whose profile models differ are still told apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata

from multislice.config.models import RunSpec
from multislice.errors import InputError

#: The distribution name in pyproject.toml.
DISTRIBUTION = "multislice-pipelines"


def version() -> str:
    """The installed package's version (pyproject.toml ``version``), or ``0+unknown`` when not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


@functools.cache
def schema_fingerprint() -> str:
    """First 16 hex digits of the SHA-256 of the run spec's JSON schema (keys sorted)."""
    text = json.dumps(RunSpec.model_json_schema(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def current() -> dict[str, str]:
    """This release: ``{"version": ..., "schema": ...}``."""
    return {"version": version(), "schema": schema_fingerprint()}


class ReleaseMismatch(InputError):
    """The pipeline YAML and the image that runs it are different releases."""


def check(compiled: dict[str, str] | None) -> None:
    """Compare the release a pipeline was compiled by with this image's.

    Args:
        compiled: :func:`current` as the compiling machine wrote it into the YAML; None or ``{}`` (a
            pipeline built in-process, e.g. by tests) skips the check.

    Raises:
        ReleaseMismatch: the version or the schema fingerprint differs; the message names both.
    """
    if not compiled:
        return
    here = current()
    if compiled.get("version") == here["version"] and compiled.get("schema") == here["schema"]:
        return
    raise ReleaseMismatch(
        f"release mismatch: the pipeline YAML was compiled by multislice-pipelines {compiled.get('version')} "
        f"(profile schema {compiled.get('schema')}) but runs in an image of {here['version']} "
        f"(profile schema {here['schema']})",
        "build and push the images of the YAML's release (`multislice images build` or `make images`) and "
        "recompile with their digests, or recompile the pipeline with the release the image carries",
    )
