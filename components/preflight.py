"""Component ``preflight``: AOT-compile a stage for its TPU topology (see ``multislice.steps.preflight``)."""

from components import make


def preflight(plan: str, stage: str, pipeline_run_id: str) -> dict:
    """Returns the stage's preflight report; fails (before provision) when the stage does not fit in HBM."""
    from multislice.plan import Plan
    from multislice.steps import preflight as step

    resolved = Plan.from_json(plan)
    return step.run(resolved, [resolved.stage(stage)], pipeline_run_id)[stage]


def component(base_image: str):
    """The ``preflight`` component for ``base_image``."""
    return make(preflight, base_image)
