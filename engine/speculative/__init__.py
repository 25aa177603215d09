"""Speculative decoding, split by idea:

- drafters propose trees of draft tokens (proposal: the contract; eagle_drafter over an EAGLE head, eagle;
  oracle_drafter over a known continuation);
- verification runs the rounds: one target forward over every row's tree, a path accepted by rejection (the
  arithmetic that keeps the target's output unchanged), the accepted keys and values compacted;
- auto decides each round's draft length from the step costs (step_times measures them) and the running
  acceptance, through the performance model that says when drafting pays on a Mixture-of-Experts target
  (perf_model);
- options is how a request asks for it; job is how the engine's scheduler runs it.

docs/architecture.md ("A model larger than the GPU") says why the batch size and where experts live change
the answer.
"""
