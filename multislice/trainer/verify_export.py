"""A stage's checkpoint verification and then its Hugging Face export, in one process of the trainer environment.

Usage (trainer environment): the exporter's command line (:func:`multislice.trainer.export.command`) with this
module instead::

    python -m multislice.trainer.verify_export --checkpoint-dir DIR --step N --output DIR [--report report.json] \
        [the exporter's other options] -- key=value ...   # the stage's MaxText arguments

It runs the checkpoint verifier (:func:`multislice.trainer.verify.run`: every check, with ``--step`` the expected
final step and the ``metrics.jsonl`` beside the checkpoints) and, only when its verdict is PASS, the exporter
(:func:`multislice.trainer.export.run`) in the same interpreter. What the two separate processes each paid
again is paid once: the interpreter's start, the imports of JAX, Orbax, Flax and MaxText (measured in
``benchmarks/README.md``), and JAX's CPU backend set-up. A FAIL or ERROR verdict exports nothing. The export
check's two loader processes (:class:`multislice.trainer.export.Loader`) are started first (in a verifier started
ahead, while the stage trains: :func:`warm_up`), so their imports of torch and transformers run beside the
verification; a verdict other than PASS stops them unused.

Output, read by the backends (:func:`reports_in`):

- as soon as the verification is done, one line ``multislice-verification: {JSON}`` (:data:`MARKER`): the
  verifier's report, so a reader of a running Job's log (the GKE backend's verify step) has it while the export
  goes on;
- last, one JSON document (what :func:`multislice.trainer.verify.parse_report` reads):
  ``{"verification": {...}, "export": {...} or null}``.

``--report`` (the exporter's copy of its report, local or ``gs://``) is written when the export ran.

Exit status: the verifier's when it is not PASS (1 FAIL, 2 ERROR); else the exporter's (0 PASS, 1 FAIL, 2 ERROR).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from typing import Any

from multislice.trainer import export, lean_imports, verify

#: This module, as the trainer image runs it.
MODULE = "multislice.trainer.verify_export"
#: The prefix of the line that carries the verifier's report (compact JSON) before the export starts.
MARKER = "multislice-verification: "


def command(
    checkpoint_dir: str,
    step: int,
    output: str,
    maxtext_args: list[str],
    python: str = "python",
    *,
    dtype: str | None = None,
    hub_repo: str | None = None,
    report: str | None = None,
    card: dict[str, Any] | None = None,
    export_format: str = "huggingface",
) -> list[str]:
    """The command line for a stage: :func:`multislice.trainer.export.command`'s (same arguments, an argument list,
    never a shell string) with ``-m`` this module; ``step`` is the verifier's expected step and the one exported."""
    argv = export.command(
        checkpoint_dir, step, output, maxtext_args, python, dtype=dtype, hub_repo=hub_repo, report=report, card=card,
        export_format=export_format,
    )  # fmt: skip
    return [python, "-m", MODULE, *argv[3:]]


def reports_in(output: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(verification report, export report)`` from this module's output (a process's stdout or a pod's log).

    The final document gives both; before it exists (a running process), the :data:`MARKER` line gives the
    verification and the export is None. ``(None, None)`` when neither is there yet (or the log lost them).
    """
    final = verify.parse_report(output)
    if final is not None and "verification" in final:
        return final["verification"], final.get("export")
    for line in reversed(output.splitlines()):
        if line.startswith(MARKER):
            try:
                return json.loads(line[len(MARKER) :]), None
            except json.JSONDecodeError:
                return None, None
    return None, None


def warm_up(argv: list[str]) -> None:
    """Do the verifier's and the exporter's work that needs no checkpoint ahead of their run, in a tool started
    while the stage trains (:mod:`multislice.trainer.warm`): :func:`multislice.trainer.verify.warm_up`'s imports,
    then :func:`multislice.trainer.export.warm_up` (the stage's config and tokenizer, torch and transformers, and
    the two loader processes started). Reads nothing of the checkpoint."""
    verify.warm_up(argv)
    with contextlib.redirect_stdout(sys.stderr):
        export.warm_up(verify.split_args(argv)[1])


def main(argv: list[str] | None = None) -> int:
    """CLI entry: verify, then export on PASS; prints :data:`MARKER`'s line, then both reports last."""
    argv = sys.argv[1:] if argv is None else argv
    own, maxtext_args = verify.split_args(argv)
    p = export.parser(f"python -m {MODULE}", (__doc__ or "").split("\n")[0])
    options = p.parse_args(own)
    export.check_options(p, options, maxtext_args)
    # Before MaxText is imported: the verifier needs no torch or transformers; the export imports them when it
    # uses them (lean_imports defers transformers to its first use and refuses torch only to tensorboardX).
    lean_imports.install(maxtext_args)
    checkpoint_dir = verify.checkpoint_path(str(options.checkpoint_dir))
    loaders = export.start_loaders()  # torch and transformers imported while the verifier runs; unused on a FAIL
    try:
        verification, status = verify.run(checkpoint_dir, options.step, maxtext_args)
        print(MARKER + json.dumps(verification), flush=True)
        exported = None
        if status == 0:
            gc.collect()  # the verifier's restored arrays are garbage now: the export's memory bound is its own
            exported, status = export.run(options, maxtext_args, loaders)
            if options.report:
                export.store_report(exported, options.report)
    finally:
        for loader in loaders.values():
            loader.stop()
    verify.emit_report({"verification": verification, "export": exported}, None)
    return status


if __name__ == "__main__":
    sys.exit(main())
