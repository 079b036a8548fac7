"""Step 1 of the multi-process TF fixture: a TF checkpoint written by 2 processes (jax.distributed), by hand.

    .venv/bin/python tests/data/write_multiprocess_for_tf.py
    /tmp/tfvenv/bin/python tests/data/make_tf_multiprocess_readback.py

Writes tests/data/tf_multiprocess/ckpt.index + ckpt.data-0000{0,1}-of-00002
(tests/multiprocess/child_tf_fixture.py says what it holds); step 2 records
what TensorFlow reads from it in tests/data/tf_multiprocess/tf_read.json.
"""

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "multiprocess"))
from conftest import check, launch  # noqa: E402

OUT = os.path.join(HERE, "tf_multiprocess")

if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    work = tempfile.mkdtemp()
    check(launch("child_tf_fixture.py", work, os.path.join(OUT, "ckpt")))
    shutil.rmtree(work)
    print(sorted(os.listdir(OUT)))
