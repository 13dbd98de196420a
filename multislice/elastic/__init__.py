"""Elastic training at run time: the policy (:mod:`.policy`) and the controller that applies it (:mod:`.controller`).

The package exports the policy, which the reports and the train step read (``elastic.Resize``, ``elastic.goodput``);
the controller follows a workload through a backend, one layer higher, and is imported as
``multislice.elastic.controller`` (``pyproject.toml``'s import contracts hold the two apart).
"""

from multislice.elastic.policy import Decision, Resize, decide, discard_unlogged_checkpoints, goodput, slice_timeline

__all__ = ["Decision", "Resize", "decide", "discard_unlogged_checkpoints", "goodput", "slice_timeline"]
