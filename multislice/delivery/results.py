"""A run's results read back from its run directory (local path or ``gs://``): the steps' JSON reports.

Each step writes its report to ``<output_dir>/<run_name>/reports/<stage>/<step>.json``
(:func:`multislice.steps.write_report`): ``train.json`` holds the training
metrics the train step also logs as KFP Metrics (steps trained, first and
final loss, step time in seconds, tokens/s and TFLOP/s per device, JobSet
restarts), ``verification.json`` the checkpoint verifier's verdict. Reading
them back needs no pipelines API (KFP's v2beta1 API does not serve metric
values; they live in its ML Metadata store), only read access to the run
directory. ``gs://`` paths are read and written with google-cloud-storage,
which honours ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The reports :func:`read_run` returns per stage: key -> file name.
STAGE_REPORTS = {"train": "train.json", "verification": "verification.json"}


def _split_gcs(path: str) -> tuple[str, str]:
    bucket, _, name = path.removeprefix("gs://").partition("/")
    return bucket, name


def _storage_client() -> Any:
    from google.cloud import storage

    return storage.Client()


def read_text(path: str) -> str | None:
    """The text of a local or ``gs://`` file; None when it does not exist."""
    if path.startswith("gs://"):
        from google.api_core.exceptions import NotFound

        bucket, name = _split_gcs(path)
        try:
            return _storage_client().bucket(bucket).blob(name).download_as_text()
        except NotFound:
            return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def write_text(path: str, text: str, content_type: str = "application/json") -> None:
    """Write text to a local or ``gs://`` path (local parent directories are created)."""
    if path.startswith("gs://"):
        bucket, name = _split_gcs(path)
        _storage_client().bucket(bucket).blob(name).upload_from_string(text, content_type=content_type)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")


def read_run(output_dir: str, run_name: str, stages: list[str]) -> dict[str, dict[str, Any]]:
    """Every stage's reports of a run: ``{stage: {"train": {...}, "verification": {...}}}``.

    Args:
        output_dir: The run's ``output_dir`` parameter (local path or ``gs://``).
        run_name: The run's name (for a scheduled run, the name with its ID appended).
        stages: Stage names, in order (``[s.name for s in spec.stages]``).

    Returns:
        A report missing from the run directory (a stage not reached, or
        skipped) is left out of its stage's mapping.
    """
    base = f"{output_dir.rstrip('/')}/{run_name}/reports"
    results: dict[str, dict[str, Any]] = {}
    for stage in stages:
        results[stage] = {}
        for key, file_name in STAGE_REPORTS.items():
            text = read_text(f"{base}/{stage}/{file_name}")
            if text is not None:
                results[stage][key] = json.loads(text)
    return results
