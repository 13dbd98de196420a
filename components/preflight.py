"""Component ``preflight``: AOT-compile a stage for its TPU topology (see ``multislice.steps.preflight``)."""

from kfp.dsl import HTML, Output

from components import make


def preflight(plan: str, stage: str, pipeline_run_id: str, hbm: Output[HTML]) -> dict:
    """Returns the stage's preflight report; fails (before provision) when the stage does not fit in HBM.

    ``hbm``: an HTML table of the stage's HBM use per chip, for the pipelines UI.
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("preflight:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.plan import Plan
    from multislice.steps import preflight as step

    resolved = Plan.from_json(plan)
    report = step.run(resolved, [resolved.stage(stage)], pipeline_run_id)[stage]
    with open(hbm.path, "w", encoding="utf-8") as handle:
        handle.write(step.result_page(resolved, [report]))
    return report.to_dict()


def component(base_image: str):
    """The ``preflight`` component for ``base_image``."""
    return make(preflight, base_image)
