"""Component ``plan``: validate the profile with this run's parameters (see ``multislice.steps.plan``)."""

from components import make


def plan(
    profile: dict,
    stage: str,
    run_name: str,
    backend: str,
    tpu_type: str,
    num_slices: int,
    output_dir: str,
    trainer_image: str,
    namespace: str,
    queue: str,
    priority: str,
    max_restarts: int,
    skip_preflight: bool,
    unique_run_name: bool,
    notify_webhook_secret: str,
    pipeline_run_id: str,
    steps: int,
    per_device_batch_size: float,
) -> str:
    """Returns the validated plan as JSON; fails with every bad field named."""
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("plan:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.steps import plan as step

    parameters = {
        "run_name": run_name,
        "backend": backend,
        "tpu_type": tpu_type,
        "num_slices": num_slices,
        "output_dir": output_dir,
        "trainer_image": trainer_image,
        "namespace": namespace,
        "queue": queue,
        "priority": priority,
        "max_restarts": max_restarts,
        "skip_preflight": skip_preflight,
        "unique_run_name": unique_run_name,
        "notify_webhook_secret": notify_webhook_secret,
        f"stages.{stage}.steps": steps,
        f"stages.{stage}.per_device_batch_size": per_device_batch_size,
    }
    return step.run(profile, parameters, stage, pipeline_run_id).to_json()


def component(base_image: str):
    """The ``plan`` component for ``base_image``."""
    return make(plan, base_image)
