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
    status: PipelineTaskFinalStatus,
) -> dict:
    """Deletes this pipeline run's unfinished JobSets; returns what it deleted and kept.

    ``cluster`` is the profile's cluster reference (project, location, name, access): no credentials.
    """
    from multislice.steps import cleanup as step

    return step.run(backend, output_dir, run_name, pipeline_run_id, status.state, namespace=namespace, cluster=cluster)


def component(base_image: str):
    """The ``cleanup`` component for ``base_image``."""
    return make(cleanup, base_image)
