import pytest

from tests.speculative.train_helpers import write_prompts


@pytest.fixture(scope="module")
def engine(engines):
    """The tiny Mixtral the train-draft tests train heads for."""
    return engines("mixtral")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """train-draft's prompts file of tests.speculative.train_helpers.PROMPTS."""
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
