"""Run results as files the pipelines UI shows: HTML pages (tables, embedded plots) and Markdown summaries.

KFP renders an ``HTML`` output artifact in an iframe and a ``Markdown`` one as
text in the run's page (KFP docs, "Output Artifacts": ``dsl.HTML``,
``dsl.Markdown``; Vertex AI Pipelines shows both the same way). A page here is
one self-contained file: images are embedded as base64 PNG ``data:`` URIs, no
scripts, no external links, so it renders in the UI's sandboxed iframe and
from a local file alike.

Generic helpers (for any step, e.g. preflight's HBM table):

* :func:`html_table` -> an HTML ``<table>`` string from rows of dicts;
* :func:`markdown_table` -> the same as a Markdown table;
* :func:`png_data_uri` -> an ``<img>`` tag of a matplotlib figure;
* :func:`html_page` / :func:`write_html_artifact` -> a whole page (string / file).

Step pages: :func:`train_html`, :func:`train_markdown` (from MaxText's
per-step metrics records, see :mod:`multislice.metrics`) and
:func:`verification_markdown` (from the checkpoint verifier's report).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from multislice import goodput, storage
from multislice.reports import TrainReport, VerificationReport

_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0}"
    "th,td{border:1px solid #ccc;padding:0.25em 0.6em;text-align:left}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}"
)


def _format(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if math.isfinite(value) else str(value)
    return str(value)


def html_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | Mapping[str, str]) -> str:
    """An HTML table of ``rows``, one ``<tr>`` per row, cells in the order of ``columns``.

    Args:
        rows: One mapping per row; a missing key leaves its cell empty.
        columns: Keys to show, in order; a mapping ``{key: header}`` gives
            headers other than the keys (e.g. ``{"hbm_bytes": "HBM (GiB)"}``).

    Returns:
        ``<table>...</table>``: text is HTML-escaped; ints get thousands
        separators, floats 4 significant digits; numeric cells are right-aligned
        (``class="num"``). Convert units before calling (this does not).
    """
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers.values())
    body = []
    for row in rows:
        cells = []
        for key in headers:
            value = row.get(key)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            cells.append(f"<td{' class=num' if numeric else ''}>{html.escape(_format(value))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | Mapping[str, str]) -> str:
    """A Markdown (GitHub) table of ``rows``; same arguments and formatting as :func:`html_table`."""
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(str(h)) for h in headers.values()) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(cell(_format(row.get(k))) for k in headers) + " |")
    return "\n".join(lines)


def png_data_uri(figure: Any, alt: str) -> str:
    """An ``<img>`` tag holding a matplotlib figure as an embedded PNG (base64 ``data:`` URI); closes the figure."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def html_page(title: str, body: str) -> str:
    """A complete, self-contained HTML page: ``title`` (escaped) as ``<title>`` and ``<h1>``, then raw HTML ``body``."""
    escaped = html.escape(title)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{escaped}</title>'
        f"<style>{_STYLE}</style></head>\n<body><h1>{escaped}</h1>\n{body}\n</body></html>\n"
    )


def write_html_artifact(path: str, title: str, body: str) -> str:
    """Write :func:`html_page` of ``title`` and ``body`` to ``path`` (e.g. a KFP ``Output[HTML]``'s ``.path``).

    Creates missing parent directories; returns the path written (UTF-8).
    """
    return write_text(path, html_page(title, body))


def write_text(path: str, text: str) -> str:
    """Write ``text`` (UTF-8) to ``path`` (local or ``gs://``), creating parent directories; returns the path."""
    storage.write_text(path, text)
    return str(path)


# ---------------------------------------------------------------------------
# The train step's pages.


def _last_record_per_step(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    by_step: dict[int, Mapping[str, Any]] = {}
    for record in records:
        if "step" in record:
            by_step[int(record["step"])] = record  # after a restart the re-trained step's last record wins
    return [by_step[s] for s in sorted(by_step)]


def training_figure(records: Sequence[Mapping[str, Any]], title: str) -> Any:
    """A matplotlib figure: loss per step (left) and step time in seconds per step (right).

    ``records`` are MaxText's per-step metrics (``step``, ``learning/loss``,
    ``perf/step_time_seconds``); the last record of a step wins, as in
    :func:`multislice.metrics.summarize`.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display in a pipeline pod
    import matplotlib.pyplot as plt

    steps = _last_record_per_step(records)
    x = [int(r["step"]) for r in steps]
    figure, (loss_axes, time_axes) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    loss_axes.plot(x, [float(r.get("learning/loss", math.nan)) for r in steps], marker=".", label="train")
    evals = [r for r in records if "eval_after_step" in r]
    if evals:  # MaxText's eval loss after train step N (multislice.metrics.parse_eval_line), beside train loss
        by_step = {int(r["eval_after_step"]): float(r["eval/avg_loss"]) for r in evals}
        loss_axes.plot(list(by_step), list(by_step.values()), marker="o", color="C2", label="eval")
        loss_axes.legend()
    loss_axes.set(title="loss", xlabel="step", ylabel="loss")
    time_axes.plot(x, [float(r.get("perf/step_time_seconds", math.nan)) for r in steps], marker=".", color="C1")
    time_axes.set(title="step time", xlabel="step", ylabel="seconds")
    for axes in (loss_axes, time_axes):
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    return figure


#: The train report's keys shown in the train pages, with their headers.
TRAIN_COLUMNS = {
    "steps_trained": "steps trained",
    "first_loss": "first loss",
    "final_loss": "final loss",
    "step_time_seconds": "step time (s)",
    "tokens_per_second_per_device": "tokens/s per device",
    "tflops_per_second_per_device": "TFLOP/s per device",
    "restarts": "JobSet restarts",
    "wall_seconds": "wall time (s)",
}


#: Columns added for a stage with evals (an eval split and ``eval_interval``).
EVAL_COLUMNS = {
    "first_eval_loss": "first eval loss",
    "final_eval_loss": "final eval loss",
    "final_eval_perplexity": "final eval perplexity",
}


def train_columns(report: TrainReport) -> dict[str, str]:
    """:data:`TRAIN_COLUMNS`, with :data:`EVAL_COLUMNS` after the losses when the stage logged evals."""
    if not report.evals:
        return TRAIN_COLUMNS
    keys = list(TRAIN_COLUMNS)
    at = keys.index("final_loss") + 1
    return {k: ({**TRAIN_COLUMNS, **EVAL_COLUMNS})[k] for k in [*keys[:at], *EVAL_COLUMNS, *keys[at:]]}


def train_html(stage: str, report: TrainReport, records: Sequence[Mapping[str, Any]]) -> str:
    """The train step's HTML page: a table of the train report and the loss and step-time plots (embedded PNG).

    Args:
        stage: The stage's name (page title).
        report: The train step's report (:func:`multislice.steps.train.run`).
        records: MaxText's per-step metrics records of the stage.
    """
    figure = training_figure(records, f"{stage}: loss and step time per step")
    body = html_table([report.to_dict()], train_columns(report)) + png_data_uri(
        figure, f"{stage} loss and step time per step"
    )
    if report.job_seconds:
        body += "<h2>goodput</h2><p>" + goodput_summary(report) + "</p>"
    if report.global_batch_size is not None:  # an elastic stage
        body += "<h2>elastic: slice count per step and resizes</h2>" + "<p>" + elastic_summary(report) + "</p>"
        body += html_table(report.slice_timeline, {"first_step": "first step", "last_step": "last step",
                                                   "slices": "slices"})  # fmt: skip
        body += html_table([r.model_dump() for r in report.resizes], RESIZE_COLUMNS)
    return html_page(f"train {stage}", body)


#: Columns of an elastic stage's resize table: key -> header.
RESIZE_COLUMNS = {
    "from_slices": "from slices",
    "to_slices": "to slices",
    "cause": "cause",
    "detected_at_seconds": "detected at (s)",
    "resumed_at_seconds": "resumed at (s)",
    "cost_seconds": "cost (s)",
    "resumed_from_step": "resumed from checkpoint step",
    "steps_lost": "steps lost",
    "last_loss_before": "loss before",
    "first_loss_after": "loss after",
}


def goodput_summary(report: TrainReport) -> str:
    """One sentence on a stage's goodput and its badput by cause (:mod:`multislice.goodput`)."""
    return (
        f"Goodput {report.goodput or 0:.1%}: {report.productive_seconds or 0:.1f} s productive training of a "
        f"{report.job_seconds or 0:.1f} s job (Google's ml-goodput-measurement definitions: each step once, the "
        f"first step of each attempt at the steady step time). Badput: "
        f"{goodput.badput_words(report.badput_seconds, report.job_seconds)}."
    )


def elastic_summary(report: TrainReport) -> str:
    """One sentence on an elastic stage: goodput, resizes, steps lost, and that the global batch was kept."""
    return (
        f"Goodput {report.goodput or 0:.1%} (productive training time / job time), {len(report.resizes)} resize(s), "
        f"{report.steps_lost} step(s) trained again. The global batch stayed {report.global_batch_size:g} sequences "
        "on every slice count: the lost data parallelism became gradient accumulation (MaxText "
        "gradient_accumulation_steps), so the step sequence and learning-rate schedule are unchanged."
    )


def train_markdown(stage: str, report: TrainReport) -> str:
    """The train step's Markdown run summary: what trained, the loss, throughput and restarts."""
    if report.skipped:
        return f"# train {stage}\n\nNothing trained: the stage's final checkpoint already existed.\n"
    return (
        f"# train {stage}\n\n"
        f"Trained **{report.steps_trained}** steps (JobSet `{report.jobset}`): loss "
        f"**{report.first_loss:.3f} -> {report.final_loss:.3f}**, "
        f"{report.tokens_per_second_per_device:.1f} tokens/s per device, "
        f"{report.restarts} JobSet restarts."
        + (
            f" Eval loss **{report.first_eval_loss:.3f} -> {report.final_eval_loss:.3f}** "
            f"(perplexity {report.final_eval_perplexity:.1f}, {report.evals} evals)."
            if report.evals
            else ""
        )
        + "\n\n"
        + markdown_table([report.to_dict()], train_columns(report))
        + "\n"
        + ("\n## goodput\n\n" + goodput_summary(report) + "\n" if report.job_seconds else "")
        + (
            "\n## elastic\n\n"
            + elastic_summary(report)
            + "\n\n"
            + markdown_table(report.slice_timeline, ["first_step", "last_step", "slices"])
            + "\n\n"
            + markdown_table([r.model_dump() for r in report.resizes], list(RESIZE_COLUMNS))
            + "\n"
            if report.global_batch_size is not None  # an elastic stage
            else ""
        )
        + (
            "\n## checkpoint restores\n\nThe checkpoint each attempt started from, and with emergency checkpoints "
            "the tier it came from (local: a slice's checkpoint ramdisk; persistent: the checkpoint directory).\n\n"
            + markdown_table(report.restores, ["attempt", "step", "tier", "slice"])
            + "\n"
            if any("tier" in restore for restore in report.restores)
            else ""
        )
        + (
            "\n## data read again\n\nThe stage streams its data (hf), which keeps no position in the checkpoint: "
            "after each restart the stream began again at its start, so these steps trained again on data the stage "
            "had already trained on.\n\n"
            + markdown_table(report.data_reread, ["attempt", "restored_step", "steps"])
            + "\n"
            if report.data_reread
            else ""
        )
    )


def verification_markdown(stage: str, report: VerificationReport) -> str:
    """The verify step's Markdown report: verdict, step, parameter count, and each check with its detail."""
    checks = [{"check": c.name, "result": c.result, "detail": c.detail} for c in report.checks]
    written = report.written_mesh or ""
    mesh = ", ".join(f"{k}={v}" for k, v in written.items()) if isinstance(written, Mapping) else str(written)
    lines = [
        f"# verify_checkpoint {stage}: {report.verdict}",
        "",
        f"Checkpoint step **{report.latest_step}**, {report.parameter_count or 0:,} parameters"
        + (f", written with mesh {mesh}" if mesh else "")
        + ".",
        "",
        markdown_table(checks, ["check", "result", "detail"]),
    ]
    if report.error:
        lines += ["", f"Error: {report.error}"]
    return "\n".join(lines) + "\n"
