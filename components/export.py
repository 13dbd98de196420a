"""Component ``export``: the checkpoint in Hugging Face format, checked by its logits (``multislice.steps.export``)."""

from kfp.dsl import Input, Model, Output

from components import make


def export(plan: str, stage: str, pipeline_run_id: str, model: Input[Model], hf_model: Output[Model]) -> dict:
    """Returns the exporter's report; fails unless the export's logits matched MaxText's.

    ``model``: the stage's final checkpoint from its train task. ``hf_model``: the export
    (``multislice.delivery.lineage.export_model``: its URI, parameter count and logits check as metadata;
    the file is a JSON manifest of the same).
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("export:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.delivery import lineage
    from multislice.plan import Plan
    from multislice.steps import export as step

    parsed = Plan.from_json(plan)
    resolved = parsed.stage(stage)
    lineage.check_input(resolved, dict(model.metadata))
    report = step.run(parsed, resolved, pipeline_run_id)
    hf_model.metadata.update(lineage.export_model(resolved, report))
    lineage.write_manifest(hf_model.path, hf_model.metadata)
    return report.to_dict()


def component(base_image: str):
    """The ``export`` component for ``base_image``."""
    return make(export, base_image)
