"""Component ``launch``: wait for every pod of every slice (see ``multislice.steps.launch``)."""

from components import make


def launch(plan: str, stage: str, admitted: dict) -> dict:
    """Returns the launch report with the placement map."""
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("launch:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.plan import Plan
    from multislice.steps import launch as step

    parsed = Plan.from_json(plan)
    return step.run(parsed, parsed.stage(stage), admitted).to_dict()


def component(base_image: str):
    """The ``launch`` component for ``base_image``."""
    return make(launch, base_image)
