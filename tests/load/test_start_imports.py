"""A load builds its model on the meta device without importing torch._dynamo, a slow import that a start
otherwise pays before any weight is read (engine.model.transformer.Rotary, engine.model.embedding.Embedding)."""
import subprocess
import sys

from tests import tiny_models

LOAD_EACH = """
import sys
from moedesk.engine.runtime import Engine
for folder in sys.argv[1:]:
    Engine.load(folder, device="cpu", dtype="float32").scheduler.close()
    if "torch._dynamo" in sys.modules:
        sys.exit("torch._dynamo imported loading " + folder)
print("loaded", len(sys.argv) - 1)
"""


def test_loading_every_family_leaves_torch_dynamo_unimported(tiny_checkpoint):
    folders = [str(tiny_checkpoint(arch)) for arch in tiny_models.ARCHS]
    done = subprocess.run([sys.executable, "-c", LOAD_EACH, *folders], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["loaded", str(len(folders))]
