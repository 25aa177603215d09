import shutil

import pytest


@pytest.fixture
def mixtral(tiny_checkpoint, tmp_path):
    """A copy of the tiny Mixtral checkpoint in the test's folder, for a test to damage."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("mixtral"), folder)
    return folder
