"""No long wait is silent: preflight's and the planner's AOT compiles and the export step tell what runs and
for how long while they work (:mod:`multislice.heartbeat`). The beat interval is cut to 10 ms and each fake
waits until its beat has been told (an event the tell sets), so nothing here sleeps or depends on timing."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from multislice import config, heartbeat, preflight, steps
from multislice.plan import make_plan
from multislice.preflight import CompileTimeout, planner
from multislice.reports import ExportReport
from multislice.steps import export

#: How long a fake waits for its beat before failing the test, seconds (a beat comes after 10 ms).
PATIENCE = 30


@pytest.fixture(autouse=True)
def quick_beats(monkeypatch):
    monkeypatch.setattr(heartbeat, "DEFAULT_EVERY", 0.01)


class Told:
    """A tell that records lines and sets an event when one contains ``marker``."""

    def __init__(self, marker: str) -> None:
        self.lines: list[str] = []
        self.marker = marker
        self.seen = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.marker in line:
            self.seen.set()

    def wait(self) -> None:
        assert self.seen.wait(PATIENCE), f"no line with {self.marker!r} while it worked: {self.lines}"


def seed_plan():
    spec = config.load_profile("gke-v6e-16x2-seed", {"output_dir": "gs://bucket/runs"})
    return spec, make_plan(spec.with_stages(spec.stage("seed-llama3-70b")))


def test_preflight_tells_which_stage_compiles_and_for_how_long_while_it_compiles():
    _, plan = seed_plan()
    told = Told("so far")

    class Session:
        def compile(self, request, timeout):
            told.wait()  # the compile "works" until a beat has been told
            return {"verdict": "error", "error": "stand-in"}

    reports = preflight.check_stages(plan, plan.stages, Session(), 600, tell=told)
    assert reports[0].verdict == "error"
    assert told.lines[0].startswith("AOT-compiling stage seed-llama3-70b for 2 x v6e-16 (v6e-16), at most 600 s: ")
    assert told.lines[0].endswith(" so far")


def test_the_planner_tells_which_candidate_compiles_while_it_compiles():
    spec, plan = seed_plan()
    told = Told("so far")

    class Session:
        def compile(self, request, timeout):
            told.wait()
            raise CompileTimeout("stand-in", "")

    found = planner.search(spec, spec.stage("seed-llama3-70b"), Session(), want=1, on_progress=told)
    assert not found.exhausted
    beat = next(line for line in told.lines if "so far" in line)
    assert beat.startswith("  AOT-compiling ") and " on 2 x v6e-16: " in beat


def test_the_export_step_tells_what_it_waits_for(tmp_path, monkeypatch):
    spec = config.load_profile("local", {"output_dir": str(tmp_path)})
    plan = make_plan(spec)
    stage = next(s for s in plan.stages if s.export)
    told = Told("export and logits check of")

    def run_exporter(plan, stage, pipeline_run_id, tell):
        told.wait()
        tell("the exporter's own line")
        return ExportReport(verdict="PASS", export_dir=str(tmp_path / "hf"), parameter_count=1, files=["a"])

    backend = SimpleNamespace(run_exporter=run_exporter, name="fake", holding_run=lambda *args: nullcontext())
    # the steps' lines (multislice.steps.say, which teller calls) into the recording tell
    monkeypatch.setattr(steps, "say", lambda step, message, stage=None: told(f"[{step} {stage}] {message}"))
    monkeypatch.setattr(export, "say", steps.say)
    export.run(plan, stage, "run-1", backend=backend)  # type: ignore[arg-type]
    beat = next(line for line in told.lines if "so far" in line)
    assert beat.startswith(f"[export {stage.name}] huggingface export and logits check of {stage.checkpoint_dir} ")
    assert f"[export {stage.name}] the exporter's own line" in told.lines
