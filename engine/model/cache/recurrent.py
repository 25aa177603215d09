"""A recurrent layer's state: Gated DeltaNet's (Qwen3-Next, Qwen3.5-MoE) per sequence, whatever its length.

Each row holds a matrix state [heads, key_dim, value_dim], which the layer's recurrence updates token by token,
and a short convolution's state [conv_dim, kernel - 1] (the inputs of the last kernel - 1 tokens). Nothing is
indexed by position, so a token cannot simply be left past a row's end and overwritten later: a verify forward
hands over the state after each of its tokens (`write`) and `accept` (or `rollback`) makes the state after the
last accepted one current, so that a rejected draft leaves no trace. Keeping those states costs `history`
states a row; the alternative, recomputing from the accepted tokens, would cost a second forward of the layer.
"""
from __future__ import annotations

from typing import Sequence

import torch


class RecurrentState:
    """Per layer of `layers`: the current state and convolution state of every row, and the states after each
    token of the last multi-token forward (up to `history` tokens: a verify forward's tokens)."""

    stateful = True  # a forward run twice feeds its tokens twice (a KV cache would be rewritten unchanged)

    def __init__(self, layers: Sequence[int], rows: int, heads: int, key_dim: int, value_dim: int, conv_dim: int,
                 conv_kernel: int, history: int, device, state_dtype: torch.dtype = torch.float32,
                 conv_dtype: torch.dtype = torch.float32, length: int = 0):
        """state_dtype: the matrix state's (float32 by default: it accumulates over the whole sequence);
        conv_dtype: the convolution's inputs as the layer computes them. history: the most tokens one forward
        may hand over states for (1 + the longest draft); 1 where nothing speculates. length: the positions the
        model's other kinds hold (a state has no positions; a LayerCaches' `length` is its kinds' least, which CUDA
        graphs read as the attention's length)."""
        if history < 1:
            raise ValueError(f"a recurrent state keeps at least one token's state, got history={history}")
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.state_shape, self.conv_shape = (heads, key_dim, value_dim), (conv_dim, conv_kernel - 1)
        self.history = history
        self.state_dtype, self.conv_dtype, self.device = state_dtype, conv_dtype, torch.device(device)
        self.rows, self.length = 0, 0
        # per layer: state [rows, *state_shape], conv [rows, *conv_shape], kept_state [rows, history,
        # *state_shape] after each token, kept_conv: views of the four tensors _all_* [layers, rows, ...]
        self._set(None, None, None, None)
        self.ensure(rows, length)

    def _tensors(self) -> list[torch.Tensor]:
        return self.state + self.conv + self.kept_state + self.kept_conv

    def ensure(self, rows: int, length: int) -> None:
        """Room for `rows` sequences (a state's size does not depend on `length`), keeping what is stored."""
        self.length = max(self.length, length)
        if rows <= self.rows:
            return
        # Each of the four is one tensor [layers, rows, ...] whose per-layer views the layers use: the retry's `save`
        # (before every step), `restore`, `accept` and `reorder` are then one copy each, not one a layer.
        make = lambda shape, dtype: torch.zeros((len(self.layers), rows, *shape), dtype=dtype, device=self.device)  # noqa: E731
        state, conv = make(self.state_shape, self.state_dtype), make(self.conv_shape, self.conv_dtype)
        # history 1 keeps nothing apart: a one-token forward's state is the current one (accept has nothing to undo)
        keeps = self.history > 1
        kept_state = make((self.history, *self.state_shape), self.state_dtype) if keeps else None
        kept_conv = make((self.history, *self.conv_shape), self.conv_dtype) if keeps else None
        for new, old in ((state, self._all_state), (conv, self._all_conv), (kept_state, self._all_kept_state),
                         (kept_conv, self._all_kept_conv)):
            if new is not None and old is not None:
                new[:, : old.shape[1]] = old
        self._set(state, conv, kept_state, kept_conv)
        self.rows = rows

    def _set(self, state, conv, kept_state, kept_conv) -> None:
        self._all_state, self._all_conv, self._all_kept_state, self._all_kept_conv = state, conv, kept_state, kept_conv
        views = lambda t: list(t.unbind(0)) if t is not None else []  # noqa: E731
        self.state, self.conv, self.kept_state, self.kept_conv = map(views, (state, conv, kept_state, kept_conv))

    def shrink(self, rows: int, length: int) -> None:
        self._set(None, None, None, None)
        self.rows, self.length = 0, 0
        self.ensure(rows, length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def bytes_per_position(self) -> int:
        return 0  # a row's state is all it ever takes

    def bytes_per_row(self) -> int:
        return self.nbytes() // self.rows if self.rows else 0

    def storage_key(self) -> tuple:
        """Changes when any tensor moves: graphs write the kept states too, which grow apart (`_keep_more`)."""
        return tuple(t.data_ptr() for t in self._tensors()[:1] + self.kept_state[:1]), self.rows, self.history

    def clear(self, rows: list[int]) -> None:
        """Start these rows afresh (a new sequence in a freed row): zero state, nothing convolved yet."""
        index = torch.tensor(rows, device=self.device)
        for t in (self._all_state, self._all_conv):
            t[:, index] = 0

    def save(self, rows, batch: int) -> tuple:
        """Copies of the current state and convolution state of `rows` (a tensor of row indices; None: rows
        0..batch-1), all a forward over those rows changes that a second run would not simply overwrite (the kept
        states it rewrites whole): `restore` puts them back after a forward that failed part way."""
        tensors = (self._all_state, self._all_conv)
        copies = [t[:, :batch].clone() for t in tensors] if rows is None else [t[:, rows] for t in tensors]
        return rows, copies

    def restore(self, saved: tuple) -> None:
        """The rows `save` copied hold what they held then, in place (where graphs read them)."""
        rows, copies = saved
        for t, old in zip((self._all_state, self._all_conv), copies):
            if rows is None:
                t[:, : old.shape[1]].copy_(old)
            else:
                t[:, rows] = old

    def read(self, layer: int, rows, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The current (state, convolution state) of `rows` (a tensor of `batch` row indices: copies), or of rows
        0..batch-1 where rows is None (views)."""
        i = self.index[layer]
        if rows is None:
            return self.state[i][:batch], self.conv[i][:batch]
        return self.state[i][rows], self.conv[i][rows]

    def layer_tensors(self, layer: int) -> tuple:
        """The layer's whole tensors, for a kernel that updates rows in place: (state [rows, ...], conv, kept_state
        [rows, history, ...] or None, kept_conv or None)."""
        i = self.index[layer]
        if self.kept_state:
            return self.state[i], self.conv[i], self.kept_state[i], self.kept_conv[i]
        return self.state[i], self.conv[i], None, None

    def write(self, layer: int, rows, states: torch.Tensor, convs: torch.Tensor) -> None:
        """After a forward of T tokens: states [B, T, *state_shape] and convs [B, T, *conv_shape], the layer's
        state after each token of rows `rows` (a tensor of B row indices; None: rows 0..B-1). The last becomes
        current; where drafts may be rolled back (history > 1) all T are kept for `accept`, a one-token forward's
        too, so that what `accept` reads never depends on what the host saw of the forward (CUDA graphs replay it
        without the host). A forward that will not be rolled back (a prompt) may hand over the last token's alone
        (T = 1). Everything is written in place: the tensors stay where graphs captured them."""
        i = self.index[layer]
        tokens = states.shape[1]
        if tokens > self.history:
            self._keep_more(tokens)
        _put(self.state[i], rows, states[:, -1])
        _put(self.conv[i], rows, convs[:, -1])
        if self.kept_state:
            _put(self.kept_state[i], rows, states, tokens)
            _put(self.kept_conv[i], rows, convs, tokens)

    def _keep_more(self, tokens: int) -> None:
        """Room for `tokens` states a row: a longer verify forward than any before (the model's runner makes the
        cache before it knows the longest draft)."""
        self.history = tokens
        make = lambda shape, dtype: torch.zeros((len(self.layers), self.rows, tokens, *shape), dtype=dtype,  # noqa: E731
                                                device=self.device)
        self._set(self._all_state, self._all_conv, make(self.state_shape, self.state_dtype),
                  make(self.conv_shape, self.conv_dtype))

    def accept(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """After a verify forward whose token n (node n of a draft tree, the root 0) left kept state n: row
        rows[i] continues from the state after its path's last node (the root's where nothing was accepted)."""
        if not self.kept_state:  # nothing speculates: every forward's last state is already current
            return
        index = torch.tensor(rows, device=self.device)
        last = torch.tensor([path[-1] if path else 0 for path in paths], device=self.device)
        self._all_state[:, index] = self._all_kept_state[:, index, last]
        self._all_conv[:, index] = self._all_kept_conv[:, index, last]

    def rollback(self, rows: list[int], kept: list[int]) -> None:
        """After a verify forward of a chain: row rows[i] keeps its first kept[i] tokens (>= 1, the root) and
        forgets the rest, as if they had never been fed."""
        self.accept(rows, [0] * len(rows), [list(range(1, k)) for k in kept])

    def reorder(self, block: list[int], source: list[int], length: int) -> None:
        """Row block[j] takes row block[source[j]]'s state (beam search)."""
        if source == list(range(len(block))):
            return
        rows = torch.tensor(block, device=self.device)
        origin = rows[torch.tensor(source, device=self.device)]
        for t in (self._all_state, self._all_conv):
            t[:, rows] = t[:, origin]


def _put(target: torch.Tensor, rows, value: torch.Tensor, tokens: int | None = None) -> None:
    """target[rows] = value in place (rows None: the first value.shape[0] rows); with `tokens`, into the first
    `tokens` entries of each row's history."""
    value = value.to(target.dtype)
    if rows is None:
        view = target[: value.shape[0]]
        (view if tokens is None else view[:, :tokens]).copy_(value)
    elif tokens is None:
        target[rows] = value
    else:
        target[rows, :tokens] = value
