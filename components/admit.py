"""Component ``admit``: create the stage's JobSet and wait for admission (see ``multislice.steps.admit``)."""

from components import make


def admit(plan: str, stage: str, pipeline_run_id: str) -> dict:
    """Returns the admit report (``skipped`` when the stage's final checkpoint already exists)."""
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("admit:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.plan import Plan
    from multislice.steps import admit as step

    parsed = Plan.from_json(plan)
    return step.run(parsed, parsed.stage(stage), pipeline_run_id).to_dict()


def component(base_image: str):
    """The ``admit`` component for ``base_image``."""
    return make(admit, base_image)
