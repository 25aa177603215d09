"""A load imports nothing slow it does not use: it builds its model on the meta device without importing
torch._dynamo, which a start otherwise pays before any weight is read (engine.model.transformer.Rotary,
engine.model.embedding.Embedding), and leaves scipy.optimize to the fits that need it (engine.offload.popularity,
engine.speculative.perf_model). A load onto a GPU runs one: it places experts by a popularity fitted to the
calibration's routing (engine.offload.popularity.fitted_evenness), so there only torch._dynamo is left out."""
import subprocess
import sys

import pytest

from tests import tiny_models

LOAD_EACH = """
import sys
from moedesk.engine.runtime import Engine
device, folders = sys.argv[1], sys.argv[2:]
for folder in folders:
    Engine.load(folder, device=device, dtype="float32").scheduler.close()
    for slow in ("torch._dynamo",) + (("scipy.optimize",) if device == "cpu" else ()):
        if slow in sys.modules:
            sys.exit(slow + " imported loading " + folder)
print("loaded", len(folders))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_loading_every_family_leaves_slow_imports_out(tiny_checkpoint, device):
    folders = [str(tiny_checkpoint(arch)) for arch in tiny_models.ARCHS]
    done = subprocess.run([sys.executable, "-c", LOAD_EACH, device, *folders], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["loaded", str(len(folders))]
