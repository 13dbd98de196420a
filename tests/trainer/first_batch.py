"""Run in the trainer environment: MaxText's own input pipeline, from a stage's rendered arguments, to a first batch.

Usage: ``python first_batch.py CASES.json FILES_DIR``. ``CASES.json`` maps a case name to the stage's MaxText
arguments as the plan renders them (``key=value``). First it writes the small data files the cases name under
``FILES_DIR`` (ArrayRecord and TFRecord records of ``tf.train.Example`` with MaxText's own protos, Parquet with
pyarrow, a Hugging Face dataset directory of Parquet), then, for each case, builds MaxText's config from
``base.yml`` and the arguments (``maxtext_argv``: the ``maxtext:`` and ``multislice:`` paths resolved as in a
pod), on one CPU host with 8 devices and one slice, calls ``create_data_iterator`` and takes one batch. Prints one
JSON line per case: the batch's ``inputs`` shape, its first tokens, how many are non-padding and how many
are Llama 3's BOS, its largest id, or the error.
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
    return {
        "shape": list(inputs.shape),
        "first": [int(t) for t in inputs[0][:4]],
        "nonpad": int((np.asarray(batch["inputs_segmentation"]) != 0).sum()),
        "bos": int((inputs == 128000).sum()),
        "max": int(inputs.max()),
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
