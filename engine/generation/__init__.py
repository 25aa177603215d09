"""Decoding: the decoder, the scheduler that owns it, sampling, beam search, KV cache, CUDA graphs."""
