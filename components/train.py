"""Component ``train``: follow training to its end and emit KFP metrics (see ``multislice.steps.train``)."""

from kfp.dsl import Metrics, Output

from components import make


def train(plan: str, stage: str, admitted: dict, metrics: Output[Metrics]) -> dict:
    """Returns the train report; logs step time, tokens/s and TFLOP/s per device, first and final loss."""
    from multislice.plan import Plan
    from multislice.steps import train as step

    report = step.run(Plan.from_json(plan), stage, admitted)
    if not report.get("skipped"):
        for key in (
            "steps_trained",
            "restarts",
            "first_loss",
            "final_loss",
            "step_time_seconds",
            "tokens_per_second_per_device",
            "tflops_per_second_per_device",
        ):
            metrics.log_metric(key, float(report[key]))
    return report


def component(base_image: str):
    """The ``train`` component for ``base_image``."""
    return make(train, base_image)
