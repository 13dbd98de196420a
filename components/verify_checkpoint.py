"""Component ``verify_checkpoint``: verify the stage's final checkpoint (see ``multislice.steps.verify_checkpoint``)."""

from components import make


def verify_checkpoint(plan: str, stage: str) -> dict:
    """Returns the verifier's report; fails unless its verdict is PASS."""
    from multislice.plan import Plan
    from multislice.steps import verify_checkpoint as step

    return step.run(Plan.from_json(plan), stage)


def component(base_image: str):
    """The ``verify_checkpoint`` component for ``base_image``."""
    return make(verify_checkpoint, base_image)
