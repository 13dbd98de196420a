"""Component ``provision``: capacity and Kueue objects for the run (see ``multislice.steps.provision``)."""

from components import make


def provision(plan: str, pipeline_run_id: str) -> dict:
    """Returns the provision report; node pools created are labelled with ``pipeline_run_id``."""
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("provision:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.plan import Plan
    from multislice.steps import provision as step

    return step.run(Plan.from_json(plan), pipeline_run_id).to_dict()


def component(base_image: str):
    """The ``provision`` component for ``base_image``."""
    return make(provision, base_image)
