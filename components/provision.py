"""Component ``provision``: capacity and Kueue objects for the run (see ``multislice.steps.provision``)."""

from components import make


def provision(plan: str) -> dict:
    """Returns the provision report."""
    from multislice.plan import Plan
    from multislice.steps import provision as step

    return step.run(Plan.from_json(plan)).to_dict()


def component(base_image: str):
    """The ``provision`` component for ``base_image``."""
    return make(provision, base_image)
