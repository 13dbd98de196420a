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

    ``release`` is :func:`multislice.release.current` of the compiling machine: a YAML of another
    release than this image's fails here, first, with one line naming both ({} skips the check).
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("plan:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.steps import plan as step

    parameters = {
        "run_name": run_name,
        "backend": backend,
        "tpu_type": tpu_type,
        "machine_type": machine_type,
        "num_slices": num_slices,
        "output_dir": output_dir,
        "trainer_image": trainer_image,
        "namespace": namespace,
        "queue": queue,
        "priority": priority,
        "max_restarts": max_restarts,
        "launcher": launcher,
        "skip_preflight": skip_preflight,
        "unique_run_name": unique_run_name,
        "notify_webhook_secret": notify_webhook_secret,
        "cluster_project": cluster_project,
        "cluster_location": cluster_location,
        "cluster_name": cluster_name,
        "cluster_access": cluster_access,
        "zone": zone,
        "pipeline_service_account": pipeline_service_account,
        "trainer_service_account": trainer_service_account,
        f"stages.{stage}.steps": steps,
        f"stages.{stage}.per_device_batch_size": per_device_batch_size,
    }
    return step.run(profile, parameters, stage, pipeline_run_id, release=release).to_json()


def component(base_image: str):
    """The ``plan`` component for ``base_image``."""
    return make(plan, base_image)
