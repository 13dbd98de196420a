"""Component ``plan``: validate the profile with this run's parameters (see ``multislice.steps.plan``)."""

from components import make


def plan(
    profile: dict,
    stage: str,
    run_name: str,
    backend: str,
    tpu_type: str,
    machine_type: str,
    num_slices: int,
    output_dir: str,
    trainer_image: str,
    namespace: str,
    queue: str,
    priority: str,
    max_restarts: int,
    launcher: str,
    skip_preflight: bool,
    unique_run_name: bool,
    notify_webhook_secret: str,
    cluster_project: str,
    cluster_location: str,
    cluster_name: str,
    cluster_access: str,
    zone: str,
    pipeline_service_account: str,
    trainer_service_account: str,
    pipeline_run_id: str,
    steps: int,
    per_device_batch_size: float,
    release: dict = {},  # noqa: B006 - kfp needs a literal default; never mutated
) -> str:
    """Returns the validated plan as JSON; fails with every bad field named.

    The run parameters and the stage's (``steps``, ``per_device_batch_size``) are
    :mod:`multislice.config.parameters`' table, written out because KFP builds the component from this signature.

    ``release`` is :func:`multislice.release.current` of the compiling machine: a YAML of another
    release than this image's fails here, first, with one line naming both ({} skips the check).
    """
    arguments = dict(locals())  # the parameters, by name (nothing else is bound yet)
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("plan:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.config.parameters import RUN_PARAMETERS, STAGE_FIELDS
    from multislice.steps import plan as step

    # The signature above is the table's (tests/config/test_parameters.py checks it): KFP reads its parameters from it.
    parameters = {p.name: arguments[p.name] for p in RUN_PARAMETERS}
    parameters |= {f"stages.{stage}.{field}": arguments[field] for field, _, _ in STAGE_FIELDS}
    return step.run(profile, parameters, stage, pipeline_run_id, release=release, hold=True).to_json()


def component(base_image: str):
    """The ``plan`` component for ``base_image``."""
    return make(plan, base_image)
