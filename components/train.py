"""Component ``train``: follow training to its end and emit KFP metrics (see ``multislice.steps.train``)."""

from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from components import make


def train(
    plan: str,
    stage: str,
    admitted: dict,
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    curves: Output[HTML],
    summary: Output[Markdown],
    model: Output[Model],
) -> dict:
    """Returns the train report; logs step time, tokens/s and TFLOP/s per device, first and final loss, goodput
    with its badput by cause (``badput_<cause>_seconds``, ``multislice.goodput``) and steps lost (an elastic
    stage also resizes).

    ``dataset`` is the stage's data from prepare_data (lineage: the pipelines UI shows data -> train); the
    stage's MaxText arguments already read the same directory.

    ``curves`` is an HTML page with the loss and step-time plots; ``summary`` the Markdown run summary;
    ``model`` the stage's final checkpoint (``multislice.delivery.lineage.checkpoint_model``: its URI, step,
    parameter count, final loss and MaxText version as metadata; the file is a JSON manifest of the same).
    """
    from multislice import cancel  # first: from here on SIGTERM/SIGINT raise cancel.Cancelled

    cancel.point("train:entry")  # a signal before install ends the process: nothing was created yet
    cancel.install()
    from multislice.delivery import lineage
    from multislice.plan import Plan
    from multislice.steps import train as step

    parsed = Plan.from_json(plan)
    resolved = parsed.stage(stage)
    report = step.run(parsed, resolved, admitted)
    if not report.skipped:
        for key in (
            "steps_trained",
            "restarts",
            "first_loss",
            "final_loss",
            "step_time_seconds",
            "tokens_per_second_per_device",
            "tflops_per_second_per_device",
        ):
            metrics.log_metric(key, float(getattr(report, key)))
        if report.goodput is not None:  # productive training time / job time (multislice.goodput)
            metrics.log_metric("goodput", float(report.goodput))
            metrics.log_metric("steps_lost", float(report.steps_lost or 0))
            for cause, seconds in report.badput_seconds.items():
                metrics.log_metric(f"badput_{cause}_seconds", float(seconds))
        if report.global_batch_size is not None:  # an elastic stage
            metrics.log_metric("resizes", float(len(report.resizes)))
        for key in ("first_eval_loss", "final_eval_loss", "final_eval_perplexity"):
            if getattr(report, key) is not None:  # stages with an eval split and eval_interval
                metrics.log_metric(key, float(getattr(report, key)))
    model.metadata.update(lineage.checkpoint_model(parsed, resolved, report))
    if dataset.metadata.get("fingerprint"):  # prepare_data's manifest: the data this model was trained on
        model.metadata["data_fingerprint"] = dataset.metadata["fingerprint"]
    lineage.write_manifest(model.path, model.metadata)
    pages = step.result_pages(parsed, resolved, report)
    for artifact, text in ((curves, pages["html"]), (summary, pages["markdown"])):
        with open(artifact.path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return report.to_dict()


def component(base_image: str):
    """The ``train`` component for ``base_image``."""
    return make(train, base_image)
