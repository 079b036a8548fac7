"""Step 2 of tests/data/make_tf_quantized_fixtures.py: TF's quantized checkpoints, read and written back by us.

    .venv/bin/python tests/data/write_quantized_ours.py

Reads tests/data/tf_quantized/tf_object-1 and tf_name with `read_checkpoint` (quantized values come
out as their integer storage, tagged with the TF type) and writes every key back with `write_bundle`
(and the object graph) as ours_object-1 and ours_name; TF then checks them (step 3).
tests/checkpoint/storage/test_quantized.py calls `write_back` and compares the files byte for byte.
"""

import os

import checkpoint
from checkpoint._keys import OBJECT_GRAPH_KEY
from checkpoint._storage import write_bundle

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_quantized")


def write_back(source: str, target: str) -> str:
    reader = checkpoint.read_checkpoint(source)
    tensors = {key: reader.get(key) for key in reader.keys()}
    if reader.object_graph is not None:
        tensors[OBJECT_GRAPH_KEY] = reader.object_graph.SerializeToString()
    write_bundle(target, tensors)
    return target


if __name__ == "__main__":
    for ours, theirs in (("ours_object-1", "tf_object-1"), ("ours_name", "tf_name")):
        write_back(os.path.join(OUT, theirs), os.path.join(OUT, ours))
