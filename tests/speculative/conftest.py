import pytest

from moedesk.engine.runtime import Engine
from tests.speculative.train_helpers import write_prompts


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """engines(arch, offload=False) -> a float32 CPU engine of that tiny model (experts offloaded to the simulated
    GPU tier at budget 0 when offload), loaded once per module."""
    made = {}

    def get(arch, offload=False):
        if (arch, offload) not in made:
            kw = dict(offload=True, gpu_budget=0) if offload else {}
            made[arch, offload] = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32", **kw)
        return made[arch, offload]

    return get


@pytest.fixture(scope="module")
def engine(engines):
    """The tiny Mixtral the train-draft tests train heads for."""
    return engines("mixtral")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """train-draft's prompts file of tests.speculative.train_helpers.PROMPTS."""
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
