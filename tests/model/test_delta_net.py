"""Gated DeltaNet (engine.model.delta_net) against transformers' own PyTorch forms of the recurrence, in float64:
the chunked form across chunk boundaries with padding, the token-by-token form, and a draft tree whose tokens
each continue their parent's state."""
import pytest
import torch
import torch.nn.functional as F

from moedesk.engine.model.delta_net import chunked_delta_rule, l2_normalise, recurrent_delta_rule, tree_parents
from moedesk.engine.speculative.proposal import tree_mask

B, HEADS, DK, DV = 2, 4, 8, 6


def inputs(tokens, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    q, k = l2_normalise(randn(B, tokens, HEADS, DK)), l2_normalise(randn(B, tokens, HEADS, DK))
    return dict(q=q, k=k, v=randn(B, tokens, HEADS, DV),
                g=-F.softplus(randn(B, tokens, HEADS)) * 0.5,
                beta=torch.sigmoid(randn(B, tokens, HEADS))), randn(B, HEADS, DK, DV) * 0.3


def theirs(form, x, state):
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    # transformers scales q by dk ** -0.5 itself; ours is handed q already scaled.
    fn = m.torch_chunk_gated_delta_rule if form == "chunk" else m.torch_recurrent_gated_delta_rule
    out, last = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=state.clone(),
                   output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out.double(), last.double()


def scaled(x):
    return {**x, "q": x["q"] * DK ** -0.5}


@pytest.mark.parametrize("tokens", [1, 5, 64, 70, 131])
def test_chunked_and_recurrent_forms_equal_transformers(tokens):
    """transformers computes in float32 (its tolerance here); ours in float64 agree with each other to 1e-10."""
    x, state = inputs(tokens)
    close = dict(rtol=1e-5, atol=2e-6)
    want_out, want_state = theirs("chunk", x, state)
    out, last = chunked_delta_rule(**scaled(x), state=state)
    torch.testing.assert_close(out, want_out, **close)
    torch.testing.assert_close(last, want_state, **close)
    steps_out, states = recurrent_delta_rule(**scaled(x), state=state)
    torch.testing.assert_close(steps_out, theirs("recurrent", x, state)[0], **close)
    torch.testing.assert_close(steps_out, out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states[:, -1], last, rtol=1e-10, atol=1e-10)
    if tokens > 1:  # every token's state handed back: the state after token t is the run of t + 1 tokens
        part = {k: v[:, :tokens // 2] for k, v in scaled(x).items()}
        torch.testing.assert_close(states[:, tokens // 2 - 1], chunked_delta_rule(**part, state=state)[1],
                                   rtol=1e-10, atol=1e-10)


def test_chunked_form_passes_a_padded_rows_state_through_the_padding():
    """beta = 0 and g = 0 past a row's end (what the layer gives padding): the row's final state and outputs are
    those of its real tokens alone, across a chunk boundary."""
    x, state = inputs(100, seed=1)
    real = 67
    padded = {k: v.clone() for k, v in x.items()}
    padded["beta"][1, real:] = 0
    padded["g"][1, real:] = 0
    out, last = chunked_delta_rule(**scaled(padded), state=state)
    alone = {k: v[1:, :real] for k, v in scaled(x).items()}
    want_out, want_states = recurrent_delta_rule(**alone, state=state[1:])
    torch.testing.assert_close(last[1:], want_states[:, -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1:, :real], want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last[:1], chunked_delta_rule(**scaled(x), state=state)[1][:1])  # row 0 unpadded


def test_a_tree_in_one_pass_equals_each_branch_alone():
    """Nodes 0 (root), 1 and 2 (children of the root), 3 (child of 2), 4 (child of 3), 5 (child of 1): each
    node's output and state equal those of its root-to-node branch run as a chain."""
    parents = [-1, 0, 0, 2, 3, 1]
    x, state = inputs(len(parents), seed=2)
    mask = tree_mask(parents)
    length = 7  # cache positions before the tree: the tree's slots are 7..12
    full = torch.zeros(B, 1, len(parents), length + len(parents), dtype=torch.bool)
    full[:, 0, :, :length] = True
    full[:, 0, :, length:] = mask
    slots = (length + torch.arange(len(parents))).expand(B, -1)
    found = tree_parents(full, slots)
    assert found.tolist() == [parents] * B
    out, states = recurrent_delta_rule(**scaled(x), state=state, parents=found)
    for node in range(len(parents)):
        branch = [node]
        while parents[branch[0]] >= 0:
            branch.insert(0, parents[branch[0]])
        chain = {k: v[:, branch] for k, v in scaled(x).items()}
        want_out, want_states = recurrent_delta_rule(**chain, state=state)
        torch.testing.assert_close(out[:, node], want_out[:, -1], rtol=0, atol=0)
        torch.testing.assert_close(states[:, node], want_states[:, -1], rtol=0, atol=0)
