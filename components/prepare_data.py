"""Component ``prepare_data``: tokenize a stage's raw text into shards (see ``multislice.steps.prepare_data``)."""

from kfp.dsl import Dataset, Output

from components import make


def prepare_data(plan: str, stage: str, dataset: Output[Dataset], pipeline_run_id: str = "") -> dict:
    """Returns the prepare_data report; ``dataset`` is the stage's shards.

    ``dataset``'s URI is the shards' directory (local or ``gs://``) and its metadata the shards' manifest
    (source files and their SHA-256, tokenizer, token and shard counts); for a stage that needs no
    preparation (synthetic, or files MaxText reads itself) its metadata says the data kind.
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("prepare_data:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.plan import Plan
    from multislice.steps import prepare_data as step

    parsed = Plan.from_json(plan)
    report = step.run(parsed, parsed.stage(stage), pipeline_run_id)
    if report.skipped:
        data = parsed.spec.stage(stage).data
        dataset.metadata["kind"] = data.kind
        with open(dataset.path, "w", encoding="utf-8") as handle:
            handle.write(data.model_dump_json())
    else:
        assert report.uri is not None  # a dataset prepared (not skipped) has its shards' directory
        dataset.uri = report.uri
        dataset.metadata.update(report.manifest)
    return report.to_dict()


def component(base_image: str):
    """The ``prepare_data`` component for ``base_image``."""
    return make(prepare_data, base_image)
