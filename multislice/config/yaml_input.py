"""User YAML (profiles, model presets, ``--set`` values) read with aliases bounded before anything is built.

PyYAML's composer shares an anchored node between its aliases, so a few KiB of nested aliases
(``&a [x, x, ...]``, ``&b [*a, *a, ...]``, ... the "billion laughs") load quickly as a shared graph; but
every copy or walk of the loaded data (:func:`multislice.config.overrides.apply_overrides` copies each
alias apart, pydantic and the MaxText schema walk every value) then visits it as the tree it stands for,
billions of values, and never ends. An alias inside its own anchor (``&a [*a]``) loads as a cycle, which
no walk ends either. :func:`load_all` counts the values each document stands for on the composed node
graph, each node once (its count memoised), and refuses a document over :data:`MAX_VALUES` or with a
cycle before any Python object is constructed. A real profile, aliases expanded, holds a few hundred
values; ``configs/*.yaml`` at most about 500.

Sources: PyYAML 6 ``yaml/composer.py`` (``compose_node`` returns ``self.anchors[anchor]`` for an alias,
the same node object; a collection's anchor is registered before its children are composed, hence
cycles) and ``yaml/__init__.py`` (``load_all``: ``check_data``/``get_data`` = ``construct_document(get_node())``).
"""

from __future__ import annotations

from typing import Any

import yaml

#: Most values (scalars, lists and mappings, each mapping key counted) one YAML document may stand for once
#: its aliases are expanded. Far above a real profile's few hundred; far below what a walk of the data cannot end.
MAX_VALUES = 100_000


_CYCLE = (
    "an alias (*name) stands inside its own anchor (&name), a value that holds itself without end; "
    "alias only a value defined before it, outside it"
)


class AliasExpansionError(Exception):
    """A YAML document whose aliases expand past :data:`MAX_VALUES` values, or hold their own anchor.

    Attributes:
        reason: In words, with the fix (``its aliases expand it to over 100,000 values ...``).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def expanded_values(node: yaml.Node, limit: int = MAX_VALUES) -> int:
    """How many values ``node`` stands for with every alias expanded, counting up to just over ``limit``.

    Each node of the composed graph is counted once (memoised by identity), so the work is linear in the
    text, not in the expansion.

    Raises:
        AliasExpansionError: more than ``limit`` values, or an alias inside its own anchor (a cycle).
    """
    counted: dict[int, int] = {}
    open_: set[int] = set()
    # An explicit stack (no recursion): (node, children visited?).
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        current, done = stack.pop()
        key = id(current)
        children: list[yaml.Node]
        if isinstance(current, yaml.MappingNode):
            children = [part for pair in current.value for part in pair]
        elif isinstance(current, yaml.SequenceNode):
            children = list(current.value)
        else:
            children = []
        if done:
            open_.discard(key)
            total = 1 + sum(counted[id(child)] for child in children)
            counted[key] = min(total, limit + 1)
            if total > limit:
                raise AliasExpansionError(
                    f"it stands for over {limit:,} values once its aliases (*name) are expanded (nested aliases, each "
                    'repeating the last: a "billion laughs"); a run spec holds a few hundred: write the values out, '
                    "or alias only small mappings"
                )
            continue
        if key in counted:
            continue
        open_.add(key)
        stack.append((current, True))
        for child in children:
            child_key = id(child)
            if child_key in open_:
                raise AliasExpansionError(_CYCLE)
            if child_key not in counted:
                stack.append((child, False))
    return counted[id(node)]


def load_all(text: str, limit: int = MAX_VALUES) -> list[Any]:
    """Every document of ``text``, read with PyYAML's safe loader, each checked by :func:`expanded_values`
    on its composed nodes before its Python objects are built.

    Raises:
        AliasExpansionError: as :func:`expanded_values`.
        yaml.YAMLError, ValueError, OverflowError, RecursionError: as ``yaml.safe_load_all``.
    """
    loader = yaml.SafeLoader(text)
    try:
        documents = []
        while loader.check_node():
            node = loader.get_node()
            if node is not None:
                expanded_values(node, limit)
            documents.append(loader.construct_document(node))
        return documents
    finally:
        loader.dispose()


def load(text: str, limit: int = MAX_VALUES) -> Any:
    """One document of ``text`` as ``yaml.safe_load`` reads it (None for none), checked as :func:`load_all`.

    Raises:
        AliasExpansionError: as :func:`expanded_values`.
        yaml.YAMLError: several documents, or as ``yaml.safe_load``.
        ValueError, OverflowError, RecursionError: as ``yaml.safe_load``.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_values(node, limit)
        return loader.construct_document(node)
    finally:
        loader.dispose()
