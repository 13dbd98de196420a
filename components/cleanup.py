"""Component ``cleanup``: the exit handler (see ``multislice.steps.cleanup``)."""

from kfp.dsl import PipelineTaskFinalStatus

from components import make


def cleanup(
    backend: str,
    output_dir: str,
    run_name: str,
    pipeline_run_id: str,
    namespace: str,
    cluster: dict,
    cluster_project: str,
    cluster_location: str,
    cluster_name: str,
    cluster_access: str,
    unique_run_name: bool,
    notify_webhook_secret: str,
    status: PipelineTaskFinalStatus,
) -> dict:
    """Deletes this pipeline run's unfinished JobSets; posts the final status to the webhook, if one is set.

    ``cluster`` is the profile's cluster section (no credentials); the run's ``cluster_*`` parameters
    replace its project, location, name and access ('' unsets one), as the plan step applies them.
    The webhook URL is no parameter: on KFP it is ``$MULTISLICE_NOTIFY_WEBHOOK_URL`` from the Kubernetes
    Secret the compiled pipeline mounts; on Vertex AI it is read from Secret Manager (``notify_webhook_secret``).
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("cleanup:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.steps import cleanup as step

    given = {"project": cluster_project, "location": cluster_location, "name": cluster_name}
    cluster = {**cluster, **{key: value or None for key, value in given.items()}, "access": cluster_access}

    report = step.run(
        backend,
        output_dir,
        run_name,
        pipeline_run_id,
        status.state,
        namespace=namespace,
        cluster=cluster,
        unique_run_name=unique_run_name,
        notify_webhook_secret=notify_webhook_secret,
        error_message=status.error_message,
        pipeline_job=status.pipeline_job_resource_name,
    )
    return report.to_dict()


def component(base_image: str):
    """The ``cleanup`` component for ``base_image``."""
    return make(cleanup, base_image)
