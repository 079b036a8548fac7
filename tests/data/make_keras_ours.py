"""Step 2 of make_keras_fixtures.py: our code writes .weights.h5 files for Keras to load.

Run by make_keras_fixtures.py with the project's Python (which has no TensorFlow or Keras):

    .venv/bin/python tests/data/make_keras_ours.py PLAN.json

PLAN.json maps each file to write under tests/data/keras_weights/ours/ to [source, like]: the
file checkpoint.keras.load_weights reads (relative to keras_weights/), and the Keras file whose
layout checkpoint.keras.save_weights copies (null: the layout the source itself records).
"""

import json
import os
import sys

from checkpoint import keras

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_weights")


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    for out, (source, like) in plan.items():
        weights = keras.load_weights(os.path.join(HERE, source))
        keras.save_weights(os.path.join(HERE, "ours", out), weights,
                           like=None if like is None else os.path.join(HERE, like))
        print(f"ours/{out} <- {source}" + (f" (layout of {like})" if like else ""))


if __name__ == "__main__":
    main(sys.argv[1])
