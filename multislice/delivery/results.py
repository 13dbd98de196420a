"""A run's results read back from its run directory (local path or ``gs://``): the steps' reports.

Each step writes its report to ``<output_dir>/<run_name>/reports/<stage>/<step>.json``
(:mod:`multislice.reports`): ``train.json`` holds the training metrics the
train step also logs as KFP Metrics (steps trained, first and final loss,
step time in seconds, tokens/s and TFLOP/s per device, JobSet restarts),
``verification.json`` the checkpoint verifier's verdict. Reading them back
needs no pipelines API (KFP's v2beta1 API does not serve metric values; they
live in its ML Metadata store), only read access to the run directory,
through :mod:`multislice.storage` (``gs://`` by gcsfs, which honours
``STORAGE_EMULATOR_HOST``).
"""

from __future__ import annotations

from multislice import identity, storage
from multislice.reports import StepReport, TrainReport, VerificationReport, parse, report_path

#: The reports :func:`read_run` returns per stage: key -> report type.
STAGE_REPORTS: dict[str, type[StepReport]] = {"train": TrainReport, "verification": VerificationReport}


def read_run(output_dir: str, run_name: str, stages: list[str]) -> dict[str, dict[str, StepReport]]:
    """Every stage's reports of a run: ``{stage: {"train": TrainReport, "verification": VerificationReport}}``.

    Args:
        output_dir: The run's ``output_dir`` parameter (local path or ``gs://``).
        run_name: The run's name (for a scheduled run, the name with its ID appended).
        stages: Stage names, in order (``[s.name for s in spec.stages]``).

    Returns:
        A report missing from the run directory (a stage not reached, or
        skipped) is left out of its stage's mapping.
    """
    run_dir = identity.run_dir(output_dir, run_name)
    results: dict[str, dict[str, StepReport]] = {}
    for stage in stages:
        results[stage] = {}
        for key, kind in STAGE_REPORTS.items():
            data = storage.read_json(report_path(run_dir, kind.file_name, stage))
            if data is not None:
                results[stage][key] = parse(kind, data)
    return results
