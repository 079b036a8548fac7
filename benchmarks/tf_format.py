"""TF TensorBundle read/write speed against raw numpy I/O of the same bytes (the limit).

    .venv/bin/python -m benchmarks.tf_format

Reading: open the checkpoint and read every tensor into a dict, checksums verified, vs
``np.fromfile`` of each tensor's bytes at offsets known in advance. Writing: ``write_bundle``
(data, crc32c, index, fsyncs, renames) vs ``ndarray.tofile`` of each tensor into one file then
an fsync (a write is not safe before its bytes are on disk; tensorstore, under orbax, syncs
too); both write new files (the previous run's are deleted, untimed). Files stay in the page cache; each figure
is the minimum of several runs (the machine is noisy).
Targets (issue 5): both ratios <= 1.3; issue 13: the 64 tensors / 256 MB read <= 1.1.
"""

import os
import tempfile

import numpy as np

from benchmarks._common import best
from checkpoint._storage import BundleReader, write_bundle

REPEATS = 7
CASES = [("64 tensors / 256 MB", 64, 256 << 20), ("2,000 tensors / 32 MB", 2000, 32 << 20)]


def remove(*paths):
    # Writes go to files that do not exist yet: freeing the last run's pages is not part of a write.
    for p in paths:
        if os.path.exists(p):
            os.remove(p)


def run_case(d: str, label: str, count: int, total: int) -> list:
    rng = np.random.default_rng(0)
    per = total // count // 4
    tensors = {f"layer_{i:04d}/kernel": rng.standard_normal(per, dtype=np.float32) for i in range(count)}
    prefix, raw_path = os.path.join(d, "ckpt"), os.path.join(d, "raw.bin")

    def raw_write():
        with open(raw_path, "wb") as f:
            for v in tensors.values():
                v.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    data_path = prefix + ".data-00000-of-00001"
    write_ours = best(lambda: write_bundle(prefix, tensors), lambda: remove(prefix + ".index", data_path), REPEATS)
    write_raw = best(raw_write, lambda: remove(raw_path), REPEATS)

    reader = BundleReader(prefix)  # offsets for the raw anchor, found outside the timing
    layout = [(reader.entry(k).offset, reader.dtype(k), reader.shape(k)) for k in reader.keys()]

    def read_ours():
        with BundleReader(prefix) as r:
            return {k: r.get(k) for k in r.keys()}

    def read_raw():
        with open(data_path, "rb") as f:
            return [np.fromfile(f, dt, int(np.prod(shape)), offset=off - f.tell()).reshape(shape)
                    for off, dt, shape in layout]

    got = read_ours()
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())
    rows = [(label, "read", best(read_ours, repeats=REPEATS), best(read_raw, repeats=REPEATS)),
            (label, "write", write_ours, write_raw)]
    os.remove(raw_path)
    return rows


def main():
    with tempfile.TemporaryDirectory() as d:
        rows = [row for case in CASES for row in run_case(d, *case)]
    print(f"{'case':24} {'op':6} {'ours (s)':>9} {'numpy (s)':>10} {'ratio':>6}")
    for label, op, ours, raw in rows:
        print(f"{label:24} {op:6} {ours:9.4f} {raw:10.4f} {ours / raw:6.2f}")
    print("reference (issue 5, another machine): tf.train.load_checkpoint + get_tensor of every key: 0.09 s, 0.13 s")


if __name__ == "__main__":
    main()
