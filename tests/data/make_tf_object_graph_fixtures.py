"""Writes the object-based (TF2 tf.train.Checkpoint) fixtures under tests/data/tf_object_graph/.

Run by hand with TensorFlow (never imported by the package or the tests):

    /work/tfvenv/bin/python tests/data/make_tf_object_graph_fixtures.py

A tf.Module `model` (kernel, bias, a list holding `scale`, and a dict `nested`
that reaches `kernel` a second time, deeper) and a tf.compat.v1 AdamOptimizer
after one step, saved with tf.train.Checkpoint(model=..., optimizer=...).save.

Outputs:
- ckpt-1.{index,data-00000-of-00001} and `checkpoint`: the checkpoint TF wrote.
- graph.json: TF's object graph, canonical: per node path its children's local names,
  attributes (name, checkpoint_key) and slot references (primary path, slot name, slot
  path); plus every key with dtype, shape and values (flattened).
"""

import json
import os
import shutil

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_object_graph")


class Model(tf.Module):
    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) / 10, name="kernel")
        self.bias = tf.Variable(np.array([0.5, -0.5, 1.0], np.float32), name="bias")
        self.layers = [tf.Variable(2.0, name="scale")]
        self.nested = {"deep": self.kernel}


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    model = Model()
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    variables = [model.kernel, model.bias, model.layers[0]]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model.kernel**2) + tf.reduce_sum(model.bias * 3.0) + model.layers[0] ** 3
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(OUT, "ckpt"))

    reader = tf.train.load_checkpoint(path)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    paths = {0: ""}
    queue = [0]
    while queue:
        i = queue.pop(0)
        for ref in graph.nodes[i].children:
            if ref.node_id not in paths:
                paths[ref.node_id] = (paths[i] + "/" if paths[i] else "") + ref.local_name
                queue.append(ref.node_id)
    for i, node in enumerate(graph.nodes):
        for ref in node.slot_variables:
            paths[ref.slot_variable_node_id] = f"{paths[ref.original_variable_node_id]}#{ref.slot_name}@{paths[i]}"
    nodes = {}
    for i, node in enumerate(graph.nodes):
        nodes[paths[i]] = {
            "children": sorted(r.local_name for r in node.children),
            "attributes": sorted([a.name, a.checkpoint_key] for a in node.attributes),
            "slots": sorted(
                [paths[r.original_variable_node_id], r.slot_name, paths[r.slot_variable_node_id]]
                for r in node.slot_variables
            ),
        }
    values = {}
    for key, shape in tf.train.list_variables(path):
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            continue
        x = reader.get_tensor(key)
        values[key] = {"dtype": str(x.dtype), "shape": list(shape), "values": np.asarray(x).ravel().tolist()}
    with open(os.path.join(OUT, "graph.json"), "w") as f:
        json.dump({"nodes": nodes, "values": values}, f, indent=1, sort_keys=True)
    print(path, len(nodes), "nodes,", len(values), "values")


if __name__ == "__main__":
    main()
