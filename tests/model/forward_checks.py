"""Checks of the model forward that several families' tests make: a run of tokens into a cache, and a draft tree
verified in one pass."""
import torch


def run(engine, cache, ids, start, **kw):
    """engine.model's forward of `ids` at positions start.. of the cache's row 0."""
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)
    return engine.model(torch.tensor([ids]), positions, cache, engine.executor, **kw)


def assert_tree_equals_each_branch(engine):
    """Prompt, then a tree: root r at position p, children a and b both at p + 1, a's child c at p + 2, in cache
    slots p..p+3, each node seeing the prompt and its ancestors only. One pass over the tree must give each node
    the logits its branch gives run alone after the same prompt."""
    prompt = engine.tokenizer.encode("hello world over the lazy")
    p = len(prompt)
    r, a, b, c = 5, 17, 23, 42

    def after_prompt():
        cache = engine.model.new_cache(1, 32, torch.float32, "cpu")
        run(engine, cache, prompt, 0)
        return cache

    seen = torch.zeros(4, 4, dtype=torch.bool)
    for node, parent in enumerate([-1, 0, 0, 1]):
        seen[node] = seen[parent] if parent >= 0 else False
        seen[node, node] = True
    mask = torch.cat([torch.ones(4, p, dtype=torch.bool), seen], dim=1).view(1, 1, 4, p + 4)
    tree = engine.model(torch.tensor([[r, a, b, c]]), torch.tensor([[p, p + 1, p + 1, p + 2]]), after_prompt(),
                        engine.executor, mask=mask, slots=torch.arange(p, p + 4).unsqueeze(0))[0]
    for branch, nodes in (([r, a, c], [0, 1, 3]), ([r, b], [0, 2])):
        torch.testing.assert_close(tree[nodes], run(engine, after_prompt(), branch, p)[0], atol=1e-5, rtol=1e-5)
