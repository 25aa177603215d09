"""Speculative decoding: the EAGLE draft head (eagle), the arithmetic that verifies its drafts
without changing the target's output (rejection), and the performance model that decides when
drafting pays on a Mixture-of-Experts target and how long the draft should be (perf_model).

Each module stands alone: none of them runs the target model, so the decoding loop decides how
they are wired together (docs/architecture.md, "A model larger than the GPU", says why the batch size
and where experts live change the answer).
"""
