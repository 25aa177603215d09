"""The kinds of cache a model's layers keep per sequence, and one interface over them.

Every kind holds `rows` sequences (one row each) for the layers it serves and answers the same row operations,
which is all a runner (engine.generation.runner) asks of a cache:

- `ensure(rows, length)` grows it, keeping what it holds; `shrink(rows, length)` reallocates it empty;
- `nbytes()`, `bytes_per_position()`: its memory now, and what one more position of every row costs;
- `storage_key()` changes whenever its tensors move (CUDA graphs read them in place);
- `stateful` (optional, default False): a forward run twice would feed its tokens twice (a recurrent state), so
  nothing may run a step again after it ran once (CUDA graphs' warm-up, an out-of-memory retry of a capture);
  such a kind has `save(rows, batch)` (copies of what a forward over those rows changes) and `restore(saved)`,
  which a runner uses to retry a forward that ran out of memory part way;
- `reorder(block, source, length)`: row block[j] takes what row block[source[j]] holds (beam search's forks);
- `accept(rows, starts, paths)`: after a verify forward that wrote draft node n of row rows[i] at slot
  starts[i] + n (the root, node 0, at starts[i]), keep the nodes of paths[i] (root to leaf, root excluded) as
  positions starts[i] + 1, + 2, ... and leave no trace of the others (speculation's rollback).

The kinds: `positional.PositionalCache` (a tensor per layer indexed by position: the KV cache, MLA's latent
cache), `sliding.SlidingWindowCache` (the last W positions in a ring), `recurrent.RecurrentState` (a fixed
state per sequence, with the states of a verify's tokens kept until `accept`), and `layers.LayerCaches`, a
model's cache made of several kinds, each serving some of its layers.
"""
