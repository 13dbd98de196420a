"""Component ``verify_checkpoint``: verify the stage's final checkpoint (see ``multislice.steps.verify_checkpoint``)."""

from kfp.dsl import Input, Markdown, Model, Output

from components import make


def verify_checkpoint(
    plan: str, stage: str, pipeline_run_id: str, model: Input[Model], verification: Output[Markdown]
) -> dict:
    """Returns the verifier's report; fails unless its verdict is PASS. ``verification``: the report as Markdown.

    ``model``: the stage's final checkpoint from its train task (refused if it is another stage's).
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("verify_checkpoint:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.delivery import artifacts, lineage
    from multislice.plan import Plan
    from multislice.steps import verify_checkpoint as step

    parsed = Plan.from_json(plan)
    resolved = parsed.stage(stage)
    lineage.check_input(resolved, dict(model.metadata))
    report = step.run(parsed, resolved, pipeline_run_id)  # a FAIL's page is in the run directory
    with open(verification.path, "w", encoding="utf-8") as handle:
        handle.write(artifacts.verification_markdown(stage, report))
    return report.to_dict()


def component(base_image: str):
    """The ``verify_checkpoint`` component for ``base_image``."""
    return make(verify_checkpoint, base_image)
