"""read_saved_model refuses an assets/ directory that links out of the SavedModel, as checkpoint.load does."""

import os
import re
import shutil

import pytest

from checkpoint import CheckpointFormatError
from checkpoint._tf._saved_model import read_saved_model

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_saved_model")


def test_an_assets_directory_linked_outside_the_saved_model_is_refused(tmp_path):
    model = tmp_path / "module"
    shutil.copytree(os.path.join(DATA, "module"), model)
    outside = tmp_path / "elsewhere"
    shutil.move(model / "assets", outside)  # the same files, so only the link is to blame
    os.symlink(outside, model / "assets")
    with pytest.raises(CheckpointFormatError, match=re.escape(
            f"asset 'vocab': the assets directory {model / 'assets'} is a symbolic link to {outside}, outside the "
            f"SavedModel {model}, which read_saved_model refuses (as checkpoint.load does); copy the files themselves "
            "into assets/")):
        read_saved_model(model)


def test_an_assets_directory_linked_within_the_saved_model_still_reads(tmp_path):
    model = tmp_path / "module"
    shutil.copytree(os.path.join(DATA, "module"), model)
    shutil.move(model / "assets", model / "files")
    os.symlink("files", model / "assets")
    with open(read_saved_model(model).assets["vocab"]) as f:
        assert f.read()
