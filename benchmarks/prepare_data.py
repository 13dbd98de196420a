"""prepare_data's throughput with 1 and 2 shard workers, and each worker's peak memory.

Usage::

    PYTHONPATH=$PWD .venvs/pipeline/bin/python -m benchmarks.prepare_data [--scale 3] [--workers 1 2]

The corpus is the local profile's (the package descriptions, ``*.dist-info/METADATA``, of the trainer
environment); scale N writes N copies of each file, each with its copy number on a first line, so every
copy is a distinct document. For each worker count the corpus is prepared from scratch along the step's own
path (list, split into ranges, one trainer-environment process per range, assemble): the end-to-end
tokens/s is tokens over the whole wall time (interpreters' start and the assembly included); each worker's
tokens/s is its part's tokens over its own work seconds, and its peak resident memory is ``ru_maxrss`` from
``wait4``. The load average (``os.getloadavg``, as ``uptime`` prints it) is recorded before and after each.
Results go to ``benchmarks/results/prepare_data.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from multislice.backends.local import data_workers
from multislice.backends.local.environment import trainer_env
from multislice.config.data import TextData, TokenizerSpec, expand_files
from multislice.trainer import prepare_shards

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prepare_data.json"


def corpus_copies(site_packages: str, folder: Path, scale: int) -> int:
    """Write ``scale`` distinct copies of the local corpus into ``folder``; returns the bytes written."""
    files = expand_files(("site-packages:*.dist-info/METADATA",), ("*multislice*",), site_packages)
    written = 0
    for copy in range(scale):
        for index, path in enumerate(files):
            text = f"copy {copy}\n" + Path(path).read_text(encoding="utf-8", errors="replace")
            target = folder / f"c{copy:02d}-{index:04d}.txt"
            target.write_text(text, encoding="utf-8")
            written += target.stat().st_size
    return written


def measure(scale: int, workers: int, work: Path, site_packages: str) -> dict:
    """Prepare the corpus at ``scale`` from scratch with ``workers`` shard workers, as the step does locally; figures.

    The step's own path: :func:`multislice.trainer.prepare_shards.list_sources` (SHA-256 of each file, cached),
    :func:`~multislice.trainer.prepare_shards.work_request`, the local backend's worker processes
    (:func:`multislice.backends.local.data_workers.run`: each worker's peak RSS from ``wait4``), and
    :func:`~multislice.trainer.prepare_shards.assemble`.
    """
    corpus = work / f"corpus-{scale}-{workers}"
    corpus.mkdir()
    size = corpus_copies(site_packages, corpus, scale)
    data = TextData(files=(str(corpus / "*.txt"),), workers=workers)
    started = time.monotonic()
    sources = prepare_shards.list_sources(data, cache_file=str(work / f"hashes-{workers}.json"))
    listed = time.monotonic() - started
    request = prepare_shards.work_request(data, TokenizerSpec(), 128, str(work / f"shards-{scale}-{workers}"), sources)
    exits = data_workers.run(request, None, 6 * 3600, lambda line: None)
    manifest = prepare_shards.assemble(request, started, print)
    wall = time.monotonic() - started
    again = time.monotonic()
    prepare_shards.list_sources(data, cache_file=str(work / f"hashes-{workers}.json"))  # the reuse decision's listing
    relist = time.monotonic() - again
    return {
        "scale": scale,
        "workers": workers,
        "corpus_bytes": size,
        "files": len(manifest["sources"]),
        "tokens": manifest["token_count"],
        "shards": manifest["shard_count"],
        "wall_seconds": round(wall, 2),
        "tokens_per_second": round(manifest["token_count"] / wall),
        "per_worker": [
            {
                "index": e.index,
                "tokens": p["tokens"],
                "seconds": p["seconds"],
                "tokens_per_second": round(p["tokens"] / max(p["seconds"], 1e-9)),
                "process_seconds": e.seconds,
                "peak_rss_mib": round((e.max_rss_bytes or 0) / 2**20, 1),
            }
            for e, p in zip(exits, manifest["parts"], strict=True)
        ],  # fmt: skip
        "first_listing_seconds": round(listed, 3),
        "relisting_seconds_cached_hashes": round(relist, 3),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    """Run 1 and 2 shard workers (``--workers``) on one corpus scale, print a line each, write :data:`RESULTS`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    site_packages = str(next(trainer_env().glob("lib/python3*/site-packages")))
    rows = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-prepare-data-") as work:
        for workers in args.workers:
            row = measure(args.scale, workers, Path(work), site_packages)
            rows.append(row)
            peaks = ", ".join(f"{w['peak_rss_mib']:.0f}" for w in row["per_worker"])
            rates = ", ".join(f"{w['tokens_per_second']:,}" for w in row["per_worker"])
            print(
                f"{workers} workers: {row['corpus_bytes'] / 2**20:6.1f} MiB, {row['tokens']:>10,} tokens in "
                f"{row['wall_seconds']:.1f} s = {row['tokens_per_second']:>8,} tokens/s end to end; per worker "
                f"{rates} tokens/s, peak RSS {peaks} MiB; load average {row['load_average_after']}",
                flush=True,
            )
    result = {
        "benchmark": "prepare_data over shard workers: the local corpus at one scale, 1 and 2 worker processes "
        "(Llama 3 tiktoken, sequences of 128), listing + workers + assembly",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other work while measured",
        "python": sys.version.split()[0],
        "load_average_before": load_before,
        "rows": rows,
        "speedup_2_over_1": round(rows[-1]["tokens_per_second"] / rows[0]["tokens_per_second"], 3)
        if len(rows) > 1 else None,
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
