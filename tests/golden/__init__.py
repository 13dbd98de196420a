"""Golden files: rendered manifests and compiled pipelines, per profile.

``make goldens`` (``python -m tests.golden``) regenerates them; the tests in
``tests/test_manifests.py`` and ``tests/test_pipeline.py`` fail when the
rendering differs, so every change to what users apply or upload shows up in
review as a diff of these files.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from multislice import config
from multislice.plan import make_plan
from multislice.render import manifests

GOLDEN_DIR = Path(__file__).resolve().parent
PROFILES = ("local", "gke-v6e-16x2")
#: The pipeline/runid label value in golden manifests.
GOLDEN_RUN_ID = "golden-run"


def rendered_manifests(profile: str) -> dict[str, str]:
    """Relative path -> text of every file ``multislice render`` writes for a profile."""
    plan = make_plan(config.load_profile(profile))
    return manifests.render_files(plan, GOLDEN_RUN_ID)


def golden_files(profile: str) -> dict[str, Path]:
    """Relative path -> golden file of every rendered file of a profile (what is stored now)."""
    directory = GOLDEN_DIR / profile / "manifests"
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}


#: Golden file name of each compile target's pipeline.
PIPELINE_GOLDENS = {"kfp": "pipeline.yaml", "vertex": "pipeline.vertex.yaml"}


def compiled_pipeline(profile: str, target: str = "kfp") -> str:
    """The compiled pipeline YAML of a profile for a target, as ``make compile`` writes it."""
    from pipelines.multislice_training import compile_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        compile_pipeline(config.read_profile(profile), str(path), target=target)
        return path.read_text(encoding="utf-8")


def regenerate() -> list[Path]:
    """Rewrite every golden file; returns the paths written."""
    written = []
    for profile in PROFILES:
        directory = GOLDEN_DIR / profile / "manifests"
        directory.mkdir(parents=True, exist_ok=True)
        for stale in golden_files(profile).values():
            stale.unlink()
        for name, text in rendered_manifests(profile).items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text, encoding="utf-8")
            written.append(directory / name)
        for target, name in PIPELINE_GOLDENS.items():
            pipeline = GOLDEN_DIR / profile / name
            pipeline.write_text(compiled_pipeline(profile, target), encoding="utf-8")
            written.append(pipeline)
    return written
