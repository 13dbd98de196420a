"""Run in the trainer environment: MaxText's own input pipeline, from a stage's rendered arguments, to a first batch.

Usage: ``python first_batch.py CASES.json FILES_DIR``. ``CASES.json`` maps a case name to the stage's MaxText
arguments as the plan renders them (``key=value``). First it writes the small data files the cases name under
``FILES_DIR`` (ArrayRecord and TFRecord records of ``tf.train.Example`` with MaxText's own protos, Parquet with
pyarrow, a Hugging Face dataset directory of Parquet), then, for each case, builds MaxText's config from
``base.yml`` and the arguments (``maxtext_argv``: the ``maxtext:`` and ``multislice:`` paths resolved as in a
pod), on one CPU host with 8 devices and one slice, calls ``create_data_iterator`` and takes one batch. Prints one
JSON line per case: the batch's ``inputs`` shape, its first tokens, how many are non-padding and how many
are Llama 3's BOS, its largest id, the segments in each row and whether positions restart at 0 exactly where a
segment (a document) begins, the kind of iterator; or the error. With MaxText's elastic iterator
(``grain_use_elastic_iterator``), also its save and restore through MaxText's ``common/grain_utility.py`` as a
checkpoint does it (:func:`elastic_restore`).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import traceback
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"  # MaxText's hf pipeline must not reach the Hub: local files only
os.environ["HF_DATASETS_OFFLINE"] = "1"

TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog. " * (3 + i % 4) for i in range(64)]


def _example(text: str) -> bytes:
    from maxtext.input_pipeline.protos import example_pb2

    example = example_pb2.Example()
    example.features.feature["text"].bytes_list.value.append(text.encode())
    return example.SerializeToString()


def _tfrecord(path: Path, records: list[bytes]) -> None:
    """TFRecord framing: length, masked CRC32C of the length, data, masked CRC32C of the data (TensorFlow's
    ``tensorflow/core/lib/io/record_writer.cc``)."""
    import google_crc32c

    def masked(data: bytes) -> int:
        crc = google_crc32c.value(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    with open(path, "wb") as out:
        for record in records:
            length = struct.pack("<Q", len(record))
            out.write(length + struct.pack("<I", masked(length)) + record + struct.pack("<I", masked(record)))


def write_files(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    for name, texts in (("web", TEXTS[:40]), ("code", TEXTS[40:])):
        writer = ArrayRecordWriter(str(root / f"{name}-00000.array_record"), "group_size:1")
        for text in texts:
            writer.write(_example(text))
        writer.close()
    pq.write_table(pa.table({"text": TEXTS}), root / "rows.parquet")
    hub = root / "hub-dataset" / "data"
    hub.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": TEXTS}), hub / "train-00000-of-00001.parquet")
    tfds = root / "tfds" / "c4" / "en" / "3.1.0"
    tfds.mkdir(parents=True, exist_ok=True)
    _tfrecord(tfds / "c4-train.tfrecord-00000-of-00001", [_example(t) for t in TEXTS])


def one_batch(args: list[str]) -> dict:
    import jax
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator
    from maxtext.utils.maxtext_utils import get_mesh_from_config

    from multislice.trainer.worker import maxtext_argv

    drop = ("hardware=", "num_slices=", "dcn_", "eval_interval=", "grain_worker_count=", "base_output_directory=",
            "jax_cache_dir=", "metrics_file=", "skip_jax_distributed_system=")  # fmt: skip
    kept = [a for a in args if not a.startswith(drop)]
    one_host = ["hardware=cpu", "num_slices=1", "eval_interval=-1", "grain_worker_count=0",
                "base_output_directory=/tmp/first-batch", "enable_checkpointing=false",
                "skip_jax_distributed_system=true"]  # fmt: skip
    _, argv = maxtext_argv([*kept, *one_host])
    config = pyconfig.initialize(argv)
    mesh = get_mesh_from_config(config, jax.devices())
    train, _ = create_data_iterator(config, mesh)
    batch = next(train)
    inputs = np.asarray(batch["inputs"])
    segments = np.asarray(batch["inputs_segmentation"])
    positions = np.asarray(batch["inputs_position"])
    # Real tokens: unpacked, MaxText pads a row's segment ids, positions and tokens with the tokenizer's pad id,
    # -1 for tiktoken (input_pipeline_utils.PadOrTrimToMaxLength); packed, segment id 0 is padding.
    real = (segments > 0) & (inputs >= 0)
    # where a segment begins: a row's first token, or a token whose segment id differs from the one before it
    starts = real & ((np.arange(inputs.shape[1]) == 0) | (segments != np.roll(segments, 1, axis=1)))
    result = {
        "shape": list(inputs.shape),
        "first": [int(t) for t in inputs[0][:4]],
        "nonpad": int((segments != 0).sum()),
        "bos": int((inputs == 128000).sum()),
        "max": int(inputs.max()),
        "real": int(real.sum()),
        "segments_per_row": [len(set(row[mask].tolist())) for row, mask in zip(segments, real, strict=True)],
        "positions_restart_at_segment_starts": bool(((positions == 0) == starts)[real].all()),
        "bos_only_at_segment_starts": bool(((inputs == 128000) & ~starts).sum() == 0),
        "iterator": type(getattr(train, "local_iterator", train)).__name__,
    }
    if config.grain_use_elastic_iterator:
        evaluating = pyconfig.initialize([a for a in argv if not a.startswith("eval_interval=")] + ["eval_interval=1"])
        result["eval_shape_unpatched"] = eval_shape(evaluating, mesh)  # MaxText 0.2.5 as it is
        result["restore"] = elastic_restore(config, mesh, train)  # installs multislice.trainer.elastic_data
        result["eval_shape"] = eval_shape(evaluating, mesh)
    return result


def eval_shape(config, mesh) -> list[int] | str:
    """The shape of the eval iterator's first batch's ``inputs``, or the error."""
    import numpy as np
    from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator

    try:
        _, evaluation = create_data_iterator(config, mesh)
        return list(np.asarray(next(evaluation)["inputs"]).shape)
    except Exception as error:  # noqa: BLE001 - reported, the test names it
        return f"{type(error).__name__}: {error}"[:300]


def elastic_restore(config, mesh, train) -> dict:
    """Save the elastic iterator's position through MaxText's checkpointing code after 4 batches (step 3), restore
    it into a fresh iterator beside stale per-process files of a 4-process run (as a shrink from 4 processes
    leaves), and compare the next batches: MaxText's ``grain_utility.for_save`` and ``for_restore`` with
    :func:`multislice.trainer.elastic_data.install`, as the worker runs them."""
    import asyncio
    import tempfile
    from types import SimpleNamespace

    import numpy as np
    from etils import epath
    from maxtext.common import grain_utility
    from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator

    from multislice.trainer import elastic_data

    installed = elastic_data.install(["grain_use_elastic_iterator=true"])
    root = Path(tempfile.mkdtemp(prefix="elastic-iter-"))
    saved = root / "3" / "iter"

    class Awaiting:  # Orbax's PathAwaitingCreation, as far as GrainCheckpointable.save uses it
        async def await_creation(self):
            saved.mkdir(parents=True, exist_ok=True)
            return epath.Path(saved)

    async def save():
        await (await grain_utility.for_save(3, train, config.expansion_factor_real_data).save(Awaiting()))

    for _ in range(3):  # batches of steps 1-3
        next(train)
    asyncio.run(save())
    expected = np.asarray(next(train)["inputs"])
    for index in range(4):  # what a 4-process run's per-process save left: must not decide the restore
        (saved / f"process_{index}-of-4.json").write_text("{}")
    fresh, _ = create_data_iterator(config, mesh)

    async def load():
        manager = SimpleNamespace(directory=epath.Path(root))
        checkpointable = grain_utility.for_restore(manager, 3, fresh, config.expansion_factor_real_data)
        await (await checkpointable.load(epath.Path(saved)))

    asyncio.run(load())
    return {
        "installed": installed,
        "files": sorted(p.name for p in saved.iterdir()),
        "state": json.loads((saved / "process_0.json").read_text()),
        "next_batch_continues": bool(np.array_equal(np.asarray(next(fresh)["inputs"]), expected)),
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    write_files(Path(sys.argv[2]))
    for name, args in cases.items():
        try:
            result = one_batch(args)
        except Exception as error:  # noqa: BLE001 - reported per case, the test names it
            result = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
        print("CASE " + json.dumps({"case": name, **result}), flush=True)


if __name__ == "__main__":
    main()
