"""Imports inside functions only where they defer a heavy or optional dependency, each for a stated reason.

An import at a module's top shows what the module needs; one inside a function hides it, and is worth it only
where loading the module at start costs seconds (a CLI that answers ``--help`` in under a second, a pipeline step
that does not load Vertex's client) or the library is not in that image (the trainer's libraries in pipeline-image
code: `make lint`'s fourth contract). This test reads every function of the pipeline's packages and refuses any
other function-local import, naming it: one of our own modules or another library may wait when a comment on its
line (or the line above) gives the reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("multislice", "components", "pipelines")

#: Top-level libraries a function may import, and why. Import times measured in the pipeline environment on
#: this 2-core machine (2026-11-25, load 13-15, so high): ``python -c "import <module>"`` after ``multislice.plan``.
DEFERRED = {
    "google": "Google Cloud clients and auth: aiplatform, container_v1, storage, cloudbuild_v1 take 2-40 s to import",
    "kfp": "kfp and kfp.kubernetes: 9 s to import; only compiling and submitting need it",
    "kubernetes": "the Kubernetes client: 7 s to import; only GKE code paths need it",
    "matplotlib": "matplotlib.pyplot: 6 s to import; only drawing a run's charts needs it",
    "jsonschema": "0.4 s to import; only validating a MaxText config or a manifest needs it",
    "celpy": "CEL (lark, pendulum): 0.6 s to import; only evaluating a CRD's CEL rules needs it, not the local "
    "backend's supervisors and CLI commands that import multislice.render.schema",
    "croniter": "only schedules need it",
    "fsspec": "0.2 s to import; only matching an hf:// glob needs it, not every step that loads the config",
    "urllib3": "imported beside the Google clients' exceptions it classifies (errors.py)",
}
#: Where any library may be imported inside a function, and why.
ANYTHING_IN = {
    "components": "a KFP lightweight component's body runs alone in its container: its imports must be inside "
    "it (KFP: `kfp.dsl.component` docs, 'Python Components')",
    "multislice/trainer": "trainer-image code that pipeline-image code also imports for its names: the trainer's "
    "libraries (JAX, MaxText, Orbax, torch, Ray) load only where it runs (`make lint`'s fourth contract)",
}


def _function_local_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, whether a comment on that line or the one above gives a reason) for each import in a
    function."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    found: list[tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.lineno, node.module))

    def commented(line: int) -> bool:
        return "#" in lines[line - 1] or lines[line - 2].lstrip().startswith("#")

    return [(line, module, commented(line)) for line, module in sorted(set(found))]


def test_functions_import_only_what_must_wait():
    refused = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if any(where.startswith(prefix) for prefix in ANYTHING_IN):
                continue
            for line, module, commented in _function_local_imports(path):
                top = module.split(".")[0]
                stdlib = top in sys.stdlib_module_names
                if top in DEFERRED or (commented and not stdlib):
                    continue
                why = (
                    "the standard library: import it at the top"
                    if stdlib
                    else ("import it at the top, or say in a comment what waiting saves")
                )
                refused.append(f"{where}:{line}: {module} ({why})")
    assert not refused, "function-local imports without a reason:\n" + "\n".join(refused)
