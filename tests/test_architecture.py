"""docs/architecture.md's drawing of the packages' imports is the code's: every arrow, and no other.

The drawing (section "Packages and their imports") names groups of modules and, per group, the groups its
modules import. This test builds the import graph with grimp (the graph import-linter checks in `make lint`),
leaving out imports under ``if TYPE_CHECKING:`` as the contracts do, and compares.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import grimp
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
SECTION = "### Packages and their imports"
#: The group every other may import; it imports none of them (drawn as a line with no arrows).
FACTS = "facts"


def drawing() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(group -> the groups it imports, group -> its modules) as the document draws them."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    arrows: dict[str, set[str]] = {}
    for line in block.splitlines():
        group, _, targets = line.partition("→")
        arrows[group.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    modules: dict[str, list[str]] = {}
    for row in re.findall(r"^\| (\w+) \| (.+) \|$", section, flags=re.MULTILINE):
        group, cell = row
        if group == "package":
            continue
        cell = re.sub(r"\([^)]*\)", "", cell)  # what a parenthesis says is a note, not a module
        modules[group] = re.findall(r"`([\w.]+)`", cell)
    return arrows, modules


def group_of(module: str, modules: dict[str, list[str]]) -> str | None:
    """The group whose listed name is ``module`` or its nearest package (the root ``multislice`` only itself)."""
    best: tuple[int, str] | None = None
    for group, names in modules.items():
        for name in names:
            if module == name or (module.startswith(name + ".") and name != "multislice"):
                if best is None or len(name) > best[0]:
                    best = (len(name), group)
    return best[1] if best else None


def imports(modules: dict[str, list[str]]) -> dict[str, set[str]]:
    """Group -> the other groups its modules import directly, from the code."""
    graph = grimp.build_graph(
        "multislice", "components", "pipelines", exclude_type_checking_imports=True, cache_dir=None
    )
    unplaced = sorted(m for m in graph.modules if group_of(m, modules) is None)
    assert not unplaced, f"modules in no group of {DOC.name}'s table: {unplaced}; add each to its group"
    found: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        source = group_of(module, modules)
        for imported in graph.find_modules_directly_imported_by(module):
            target = group_of(imported, modules)
            if target != source:
                found[source].add(target)
    return found


def test_the_drawing_is_parsed():
    arrows, modules = drawing()
    assert set(arrows) == set(modules), "every group of the drawing has a row in the table, and no other"
    assert {"config", "plan", "render", "preflight", "backends", "steps", "components", "pipelines"} <= set(arrows)
    assert arrows["config"] == set() and "config" in arrows["plan"]


def test_every_arrow_is_an_import_and_every_import_an_arrow():
    arrows, modules = drawing()
    found = imports(modules)
    assert found.get(FACTS, set()) == set(), f"the facts import {sorted(found[FACTS])}"
    code = {group: sorted(targets - {FACTS}) for group, targets in found.items()}
    drawn = {group: sorted(targets) for group, targets in arrows.items()}
    missing = {g: sorted(set(code.get(g, [])) - set(drawn.get(g, []))) for g in drawn}
    extra = {g: sorted(set(drawn.get(g, [])) - set(code.get(g, []))) for g in drawn}
    assert not any(missing.values()) and not any(extra.values()), (
        f"{DOC.name} lacks the arrows { ({g: t for g, t in missing.items() if t}) } and draws arrows no import "
        f"makes { ({g: t for g, t in extra.items() if t}) }; redraw the block (imports climbing a layer also fail "
        "make lint)"
    )


@pytest.mark.parametrize(
    "module, group",
    [
        ("multislice", "api"),
        ("multislice.backends.manifests", "backends"),
        ("multislice.delivery.schedule", "submit"),
        ("multislice.storage", FACTS),
    ],
)
def test_modules_fall_in_their_group(module, group):
    assert group_of(module, drawing()[1]) == group
