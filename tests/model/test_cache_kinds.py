"""The cache kinds' row operations on the CPU, against references written here: a full cache for the sliding
window, a token-by-token Gated DeltaNet recurrence for the recurrent state. Fork (beam search) and accept or
rollback (speculation: a rejected draft leaves no trace) for each."""
import pytest
import torch
import torch.nn.functional as F

from moedesk.engine.model.cache.layers import LayerCaches
from moedesk.engine.model.cache.positional import LatentCache, PositionalCache
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.cache.sliding import SlidingWindowCache, window_mask

HEADS, DIM = 2, 4


def kv(gen, tokens):
    """Random keys and values [1, tokens, HEADS, DIM]."""
    return (torch.randn(1, tokens, HEADS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(1, tokens, HEADS, DIM, generator=gen, dtype=torch.float64))


# --- positional (KV, MLA latent) ---------------------------------------------------------------------------------

def test_latent_cache_stores_rank_plus_rope_values_a_position_and_reads_back_what_was_written():
    cache = LatentCache([1, 3], rows=2, length=6, kv_lora_rank=8, rope_dim=3, dtype=torch.float16, device="cpu")
    assert cache.bytes_per_position() == (8 + 3) * 2 * 2  # layers x (kv_lora_rank + rope dims) x dtype
    assert cache.nbytes() == 2 * 6 * cache.bytes_per_position()
    latent, rope = torch.randn(1, 4, 8).half(), torch.randn(1, 4, 3).half()
    out = cache.write_and_read(3, {"latent": latent, "rope": rope}, torch.tensor([1]), torch.arange(4)[None], 4)
    assert torch.equal(out["latent"], latent) and torch.equal(out["rope"], rope)
    assert not cache.tensors["latent"][0].any() and not cache.tensors["latent"][1][0].any()  # layer 1, row 0 untouched
    cache.ensure(3, 10)  # grows, keeping what it holds
    assert torch.equal(cache.tensors["rope"][1][1, :4], rope[0]) and cache.tensors["rope"][1].shape == (3, 10, 3)


def test_positional_fork_and_accept_keep_the_chosen_rows_and_nodes():
    cache = PositionalCache([0], {"k": (DIM,)}, rows=4, length=8, dtype=torch.float64, device="cpu")
    t = cache.tensors["k"][0]
    t.copy_(torch.randn(4, 8, DIM, dtype=torch.float64))
    before = t.clone()
    cache.reorder([1, 2, 3], [2, 2, 0], length=5)  # rows 1..3 continue rows 3, 3, 1 (block-relative 2, 2, 0)
    assert torch.equal(t[1, :5], before[3, :5]) and torch.equal(t[2, :5], before[3, :5])
    assert torch.equal(t[3, :5], before[1, :5]) and torch.equal(t[:, 5:], before[:, 5:]) and torch.equal(t[0], before[0])
    before = t.clone()
    cache.accept([0, 2], [2, 1], [[2, 4], [1, 2]])  # row 0: nodes 2 and 4 at slots 3, 4; row 2: a chain, in place
    assert torch.equal(t[0, 3], before[0, 4]) and torch.equal(t[0, 4], before[0, 6])
    assert torch.equal(t[2], before[2]) and torch.equal(t[0, :3], before[0, :3])


# --- sliding window ----------------------------------------------------------------------------------------------

def windowed_attention(q, keys, values, mask):
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=mask).transpose(1, 2)


def test_sliding_window_holds_the_last_window_positions_of_a_full_cache_and_attends_alike():
    """Chunks of several sizes (one longer than the ring): the ring's current entries are the full cache's last
    W positions, and attention through it equals full-cache attention under the window mask."""
    gen = torch.Generator().manual_seed(0)
    window, spare, total = 5, 2, 0
    ring = SlidingWindowCache([0], rows=1, window=window, spare=spare, kv_heads=HEADS, head_dim=DIM,
                              dtype=torch.float64, device="cpu")
    full = PositionalCache([0], {"k": (HEADS, DIM), "v": (HEADS, DIM)}, 1, 64, torch.float64, "cpu")
    for chunk in (3, 1, 9, 1, 1, 2, 4, 1):
        k, v = kv(gen, chunk)
        q = torch.randn(1, chunk, HEADS, DIM, generator=gen, dtype=torch.float64)
        slots = torch.arange(total, total + chunk)[None]
        keys, values, key_positions = ring.write_and_read(0, k, v, None, slots)
        got = windowed_attention(q, keys, values, window_mask(slots, key_positions, window))
        stored = full.write_and_read(0, {"k": k, "v": v}, None, slots, total + chunk)
        every = torch.arange(total + chunk)[None]
        want = windowed_attention(q, stored["k"], stored["v"], window_mask(slots, every, window))
        torch.testing.assert_close(got, want)
        total += chunk
        held = ring.slot_positions[0][0]
        current = held[(held >= 0) & (held > total - 1 - window)]
        assert sorted(current.tolist()) == list(range(max(0, total - window), total))
        for position in current.tolist():
            assert torch.equal(ring.k[0][0, position % ring.ring], full.tensors["k"][0][0, position])


def test_sliding_window_rejected_drafts_leave_no_trace():
    """A verify forward writes a draft tree; accepting a path and going on gives what feeding the accepted tokens
    alone gives, at every later step (the ring's spare slots kept what the window still needed)."""
    gen = torch.Generator().manual_seed(1)
    window, prompt = 4, 6
    ring = SlidingWindowCache([0], 1, window, spare=4, kv_heads=HEADS, head_dim=DIM, dtype=torch.float64,
                              device="cpu")
    plain = SlidingWindowCache([0], 1, window, spare=0, kv_heads=HEADS, head_dim=DIM, dtype=torch.float64,
                               device="cpu")
    k, v = kv(gen, prompt)
    for cache in (ring, plain):
        cache.write_and_read(0, k, v, None, torch.arange(prompt)[None])
    # Nodes: root (position 6), then 1 (child of root), 2 (child of root), 3 (child of 2), 4 (child of 3).
    nodes_k, nodes_v = kv(gen, 5)
    ring.write_and_read(0, nodes_k, nodes_v, None, torch.arange(prompt, prompt + 5)[None])
    ring.accept([0], [prompt], [[2, 3]])  # root, 2, 3 accepted: positions 6, 7, 8
    accepted = [0, 2, 3]
    plain.write_and_read(0, nodes_k[:, accepted], nodes_v[:, accepted], None, torch.arange(prompt, prompt + 3)[None])
    position = prompt + 3
    for step in range(6):
        k, v = kv(gen, 1)
        q = torch.randn(1, 1, HEADS, DIM, generator=gen, dtype=torch.float64)
        slots = torch.tensor([[position]])
        outs = []
        for cache in (ring, plain):
            keys, values, key_positions = cache.write_and_read(0, k, v, None, slots)
            outs.append(windowed_attention(q, keys, values, window_mask(slots, key_positions, window)))
        torch.testing.assert_close(outs[0], outs[1])
        position += 1


def test_sliding_window_fork_copies_rings_and_forgets_stale_entries_of_a_reused_row():
    ring = SlidingWindowCache([0, 1], 3, window=3, spare=1, kv_heads=HEADS, head_dim=DIM, dtype=torch.float64,
                              device="cpu")
    gen = torch.Generator().manual_seed(2)
    k, v = kv(gen, 4)
    ring.write_and_read(1, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), None, torch.arange(4).expand(3, 4))
    k2, v2 = kv(gen, 1)
    ring.write_and_read(1, k2, v2, torch.tensor([2]), torch.tensor([[4]]))
    ring.reorder([0, 1, 2], [2, 2, 2], 5)
    assert torch.equal(ring.k[1][0], ring.k[1][2]) and torch.equal(ring.slot_positions[1][1], ring.slot_positions[1][2])
    # Row 0 now starts a new sequence at position 0: nothing of the old one is current.
    keys, values, key_positions = ring.write_and_read(1, k2, v2, torch.tensor([0]), torch.tensor([[0]]))
    assert key_positions[0, :-1].eq(-1).all() and key_positions[0, -1] == 0
    assert ring.bytes_per_position() == 0 and ring.bytes_per_row() > 0


# --- recurrent state ----------------------------------------------------------------------------------------------

KEY, VALUE, CONV, KERNEL = 3, 4, 5, 4


def gated_delta_step(state, conv, x, q, k, v, g, beta):
    """One token of Gated DeltaNet as its papers write it, in float64: the short convolution's window slides by
    the token's input x; the state decays by exp(g), then takes the delta rule's correction of v at key k."""
    conv = torch.cat([conv, x.unsqueeze(-1)], dim=-1)[..., 1:]
    state = state * torch.exp(g)[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(-2)
    state = state + k.unsqueeze(-1) * ((v - remembered) * beta.unsqueeze(-1)).unsqueeze(-2)
    return state, conv, (state * q.unsqueeze(-1)).sum(-2)


def token_inputs(gen, count):
    return [dict(x=torch.randn(CONV, generator=gen, dtype=torch.float64),
                 q=torch.randn(HEADS, KEY, generator=gen, dtype=torch.float64),
                 k=F.normalize(torch.randn(HEADS, KEY, generator=gen, dtype=torch.float64), dim=-1),
                 v=torch.randn(HEADS, VALUE, generator=gen, dtype=torch.float64),
                 g=-torch.rand(HEADS, generator=gen, dtype=torch.float64),
                 beta=torch.rand(HEADS, generator=gen, dtype=torch.float64)) for _ in range(count)]


def run_alone(tokens):
    state, conv = torch.zeros(HEADS, KEY, VALUE, dtype=torch.float64), torch.zeros(CONV, KERNEL - 1, dtype=torch.float64)
    for t in tokens:
        state, conv, _ = gated_delta_step(state, conv, **t)
    return state, conv


def recurrent_cache(rows, history):
    return RecurrentState([2], rows, HEADS, KEY, VALUE, CONV, KERNEL, history, "cpu", state_dtype=torch.float64,
                          conv_dtype=torch.float64)


def feed(cache, row, tokens, parents=None):
    """A forward of `tokens` through row `row`'s state, handing every token's state over; parents: a draft tree
    (token n continues from token parents[n]'s state, the root from the row's current state)."""
    state, conv = (t[0] for t in cache.read(2, torch.tensor([row]), 1))
    states, convs = [], []
    for n, t in enumerate(tokens):
        if n > 0:
            parent = n - 1 if parents is None else parents[n]
            state, conv = states[parent], convs[parent]
        state, conv, _ = gated_delta_step(state, conv, **t)
        states.append(state)
        convs.append(conv)
    cache.write(2, torch.tensor([row]), torch.stack(states)[None], torch.stack(convs)[None])


def test_recurrent_rollback_by_k_equals_the_state_without_those_tokens():
    gen = torch.Generator().manual_seed(3)
    prompt, draft = token_inputs(gen, 6), token_inputs(gen, 5)
    for rejected in range(5):
        cache = recurrent_cache(rows=2, history=5)
        feed(cache, 1, prompt[:3])
        feed(cache, 1, prompt[3:])
        feed(cache, 1, draft)  # a verify forward of 5 tokens: the root and 4 drafts
        cache.rollback([1], [5 - rejected])
        state, conv = run_alone(prompt + draft[:5 - rejected])
        torch.testing.assert_close(cache.state[0][1], state, rtol=0, atol=0)
        torch.testing.assert_close(cache.conv[0][1], conv, rtol=0, atol=0)
        assert not cache.state[0][0].any()  # the other row untouched
        # Going on from there is going on from the tokens kept, alone.
        more = token_inputs(gen, 2)
        feed(cache, 1, more)
        state, conv = run_alone(prompt + draft[:5 - rejected] + more)
        torch.testing.assert_close(cache.state[0][1], state)


def test_recurrent_tree_accept_keeps_the_path_state():
    gen = torch.Generator().manual_seed(4)
    prompt, nodes = token_inputs(gen, 4), token_inputs(gen, 5)
    parents = [-1, 0, 0, 2, 1]  # root; 1, 2 children of the root; 3 of 2; 4 of 1
    for path, chain in (([2, 3], [0, 2, 3]), ([1, 4], [0, 1, 4]), ([2], [0, 2]), ([], [0])):
        cache = recurrent_cache(rows=1, history=5)
        feed(cache, 0, prompt)
        feed(cache, 0, nodes, parents)
        cache.accept([0], [4], [path])
        state, conv = run_alone(prompt + [nodes[n] for n in chain])
        torch.testing.assert_close(cache.state[0][0], state, rtol=0, atol=0)
        torch.testing.assert_close(cache.conv[0][0], conv, rtol=0, atol=0)


def test_recurrent_fork_grow_and_limits():
    gen = torch.Generator().manual_seed(5)
    cache = recurrent_cache(rows=3, history=2)
    for row in range(3):
        feed(cache, row, token_inputs(gen, 2))
    before = cache.state[0].clone()
    cache.reorder([1, 2], [1, 1], 9)  # rows 1 and 2 both continue row 2
    assert torch.equal(cache.state[0][1], before[2]) and torch.equal(cache.state[0][0], before[0])
    cache.ensure(5, 100)
    assert cache.state[0].shape[0] == 5 and torch.equal(cache.state[0][:3], torch.stack([before[0], before[2],
                                                                                         before[2]]))
    assert cache.bytes_per_position() == 0 and cache.bytes_per_row() * 5 == cache.nbytes()
    cache.clear([1])
    assert not cache.state[0][1].any() and cache.state[0][2].any()
    # A verify forward longer than any before: the cache keeps more states a row (its runner made it before the
    # longest draft was known), and rolling back within them still forgets exactly the rejected tokens.
    row0 = cache.state[0][0].clone()
    drafts = token_inputs(gen, 3)
    feed(cache, 0, drafts)
    assert cache.history == 3 and cache.kept_state[0].shape[1] == 3
    cache.rollback([0], [2])
    state = row0
    for t in drafts[:2]:
        state, _, _ = gated_delta_step(state, cache.conv[0][0], **t)
    torch.testing.assert_close(cache.state[0][0], state, rtol=0, atol=0)


def test_recurrent_accept_after_a_forward_of_the_root_alone_keeps_its_state():
    """A verify round that drafted nothing (the root alone, as a plain step): accepting no drafts keeps the state
    after the root, not a state an earlier, longer round left among the kept ones."""
    gen = torch.Generator().manual_seed(6)
    cache = recurrent_cache(rows=1, history=4)
    feed(cache, 0, token_inputs(gen, 3))
    feed(cache, 0, token_inputs(gen, 4))  # a round of the root and 3 drafts
    cache.rollback([0], [1])
    root = token_inputs(gen, 1)
    feed(cache, 0, root)
    after_root = cache.state[0][0].clone()
    cache.accept([0], [0], [[]])
    torch.testing.assert_close(cache.state[0][0], after_root, rtol=0, atol=0)


# --- a model's cache of several kinds ------------------------------------------------------------------------------

def test_layer_caches_route_layers_and_reach_every_kind():
    full = PositionalCache([0, 2], {"k": (DIM,)}, 2, 8, torch.float64, "cpu")
    state = RecurrentState([1, 3], 2, HEADS, KEY, VALUE, CONV, KERNEL, 3, "cpu")
    caches = LayerCaches([full, state])
    assert caches[0] is full and caches[3] is state and caches.rows == 2 and caches.length == 0
    caches.ensure(4, 16)
    assert (full.rows, full.length, state.rows) == (4, 16, 4)
    assert caches.bytes_per_position() == full.bytes_per_position()
    assert caches.nbytes() == full.nbytes() + state.nbytes()
    state.state[0][3] = 1.0
    full.tensors["k"][1][3] = 2.0
    caches.reorder([2, 3], [1, 1], 16)
    assert state.state[0][2].eq(1).all() and full.tensors["k"][1][2].eq(2).all()
    key = caches.storage_key()
    caches.ensure(6, 16)
    assert caches.storage_key() != key
    with pytest.raises(ValueError, match="two caches"):
        LayerCaches([full, PositionalCache([2], {"k": (DIM,)}, 1, 1, torch.float64, "cpu")])


def test_saved_rows_of_a_recurrent_state_come_back_in_place_and_only_they():
    """What an out-of-memory retry puts back (engine.generation.runner): the current states of the rows a forward
    touched, by index or as rows 0..B-1, into the same tensors; kinds without a state have nothing to save."""
    gen = torch.Generator().manual_seed(7)
    full = PositionalCache([0], {"k": (DIM,)}, 3, 8, torch.float64, "cpu")
    state = recurrent_cache(rows=3, history=1)
    outer = LayerCaches([LayerCaches([full, state])])  # a device's caches within the model's (layer_devices)
    for row in range(3):
        feed(state, row, token_inputs(gen, 2))
    tensors = [t.data_ptr() for t in state.state + state.conv]
    for rows, batch in ((torch.tensor([2, 0]), 2), (None, 2)):
        before = [t.clone() for t in state.state + state.conv]
        saved = outer.save(rows, batch)
        assert len(saved) == 1  # the positional kind saves nothing
        for row in range(3):
            feed(state, row, token_inputs(gen, 1))
        touched = [2, 0] if rows is not None else [0, 1]
        outer.restore(saved)
        assert [t.data_ptr() for t in state.state + state.conv] == tensors
        for now, then in zip(state.state + state.conv, before):
            for row in range(3):
                assert torch.equal(now[row], then[row]) == (row in touched)
