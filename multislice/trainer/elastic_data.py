"""Lets MaxText 0.2.5 save and restore grain's elastic iterator as the one global position it is.

An elastic stage on grain data renders ``grain_use_elastic_iterator=true`` (:func:`multislice.plan.
elastic_iterator_args`): grain's ``ElasticIterator`` keeps one position for all hosts (``global_next_index``),
so that a checkpoint restores on any host count, and MaxText's ``common/grain_utility.py`` has a case for it:
``GrainCheckpointable`` writes that state once, to ``iter/process_0.json``, and every process reads it back,
whatever ``jax.process_count()`` is now. But it picks the case with ``isinstance(local_iterator,
ElasticIterator)``, and the ``local_iterator`` that MaxText's ``MultiHostDataLoadIterator`` holds is
``iter(ElasticIterator)``: grain 0.2.18's ``_ElasticMapDatasetIterator`` (``grain/_src/python/dataset/
elastic_iterator.py``), not an ``ElasticIterator``. So MaxText takes its per-process case instead
(``process_{i}-of-{N}.json``), and after a shrink or a grow (another ``N``) ``for_restore`` fails ("N processes
found in Grain checkpoint directory ..., please set expansion_factor_real_data accordingly").

:func:`install` makes ``grain_utility``'s name ``ElasticIterator`` the pair of both classes, which its
``isinstance`` checks accept (a tuple), so the elastic case is taken: same state, one shared file. The
``_ElasticMapDatasetIterator`` has the ``get_state`` and ``set_state`` that case calls.

And the eval iterator: ``make_grain_eval_iterator`` (``input_pipeline/grain_data_processing.py``) never wraps its
data in an ``ElasticIterator``, but the shared ``data_processing_utils.format_and_batch`` and
``apply_multiprocessing_and_prefetch`` skip batching whenever ``grain_use_elastic_iterator`` is set ("ElasticIterator
batches internally"), so its batches would be single rows. The eval iterator is never checkpointed (it starts again
before every eval): :func:`install` builds it as without the elastic iterator, from a view of the config whose
``grain_use_elastic_iterator`` is false.
"""

from __future__ import annotations

from typing import Any

#: The MaxText argument that turns the elastic iterator on (``configs/base.yml``).
ELASTIC_ITERATOR_ARG = "grain_use_elastic_iterator=true"


def install(maxtext_args: list[str]) -> bool:
    """Patch MaxText's ``grain_utility`` as the module docstring says when ``maxtext_args`` turn the elastic
    iterator on; whether it did. Idempotent."""
    if ELASTIC_ITERATOR_ARG not in (arg.lower() for arg in maxtext_args):
        return False
    # grain and MaxText's checkpointing at import: only for an elastic stage on grain data, in the trainer.
    from grain._src.python.dataset.elastic_iterator import ElasticIterator, _ElasticMapDatasetIterator
    from maxtext.common import grain_utility
    from maxtext.input_pipeline import input_pipeline_interface

    grain_utility.ElasticIterator = (ElasticIterator, _ElasticMapDatasetIterator)  # pyright: ignore[reportAttributeAccessIssue]
    build_eval = input_pipeline_interface.make_grain_eval_iterator
    if not getattr(build_eval, "_without_elastic_iterator", False):

        def make_grain_eval_iterator(config: Any, global_mesh: Any, process_indices: Any) -> Any:
            view: Any = _WithoutElasticIterator(config)  # duck-typed: MaxText reads the config's attributes only
            return build_eval(view, global_mesh, process_indices)

        make_grain_eval_iterator._without_elastic_iterator = True  # pyright: ignore[reportFunctionMemberAccess]
        input_pipeline_interface.make_grain_eval_iterator = make_grain_eval_iterator
    print(
        "multislice worker: grain's elastic iterator is saved and restored as one global position "
        "(iter/process_0.json), on any process count",
        flush=True,
    )
    return True


class _WithoutElasticIterator:
    """MaxText's config as it is, but for ``grain_use_elastic_iterator``: false."""

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return False if name == "grain_use_elastic_iterator" else getattr(self._config, name)
