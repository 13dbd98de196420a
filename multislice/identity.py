"""Run identity: a run's name, its output directory and its run directory, derived in one place.

Used by the plan step, the cleanup step (which runs even when planning
failed, so it derives them from the raw parameters) and the CLI. Layout:
``<output_dir>/<run_name>`` is the run directory (:mod:`multislice.plan`).
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

from multislice import storage


@dataclass(frozen=True)
class RunIdentity:
    """Who a run is and where it writes.

    Attributes:
        run_name: The run's name (a DNS-1035 label; prefix of its JobSet names).
        output_dir: Base directory of all runs: ``gs://...``, or an absolute local path.
        run_dir: ``<output_dir>/<run_name>``.
    """

    run_name: str
    output_dir: str
    run_dir: str


def run_dir(output_dir: str, run_name: str) -> str:
    """``<output_dir>/<run_name>`` (no other change to either)."""
    return storage.join(output_dir, run_name)


#: Characters of the pipeline run's id :func:`unique_run_name` appends (after a '-').
UNIQUE_SUFFIX_CHARACTERS = 8
#: Length of the whole suffix: ``-`` and :data:`UNIQUE_SUFFIX_CHARACTERS` characters.
UNIQUE_SUFFIX_LENGTH = UNIQUE_SUFFIX_CHARACTERS + 1


def unique_run_name(run_name: str, pipeline_run_id: str) -> str:
    """``<run_name>-<8 characters of the pipeline run's id>``: the run name of one run of a schedule.

    ``pipeline_run_id`` is the value of ``{{$.pipeline_job_uuid}}`` (a UUID on
    KFP and Vertex AI); its first 8 alphanumeric characters, lower-cased, keep
    the name a DNS-1035 label (the run spec validates its length).
    """
    fragment = re.sub(r"[^a-z0-9]", "", pipeline_run_id.lower())[:UNIQUE_SUFFIX_CHARACTERS]
    return f"{run_name}-{fragment}" if fragment else run_name


def timestamped_run_name(run_name: str, now: datetime.datetime | None = None) -> str:
    """``<run_name>-<YYYYmmdd-HHMMSS>``: the name ``multislice run`` gives a run unless one is set."""
    return f"{run_name}-{(now or datetime.datetime.now()).strftime('%Y%m%d-%H%M%S')}"


def run_identity(
    run_name: str,
    output_dir: str,
    *,
    unique_run_name_from: str = "",
) -> RunIdentity:
    """Resolve a run's identity from its parameters.

    Args:
        run_name: The ``run_name`` parameter.
        output_dir: The ``output_dir`` parameter (``gs://...`` or a path; a relative path is made
            absolute against this process's working directory, since every later step and every
            pod process of the local backend must agree on it).
        unique_run_name_from: With the ``unique_run_name`` parameter true, the pipeline run's id
            (:func:`unique_run_name`); '' keeps ``run_name``.
    """
    if unique_run_name_from:
        run_name = unique_run_name(run_name, unique_run_name_from)
    if output_dir and not storage.is_remote(output_dir) and not os.path.isabs(output_dir):
        output_dir = os.path.abspath(output_dir)
    return RunIdentity(run_name, output_dir, run_dir(output_dir, run_name))
