"""`moedesk bench`: what the engine achieves on this machine, driven as a front end drives it.

synthetic: decode, prefill, batched decode and beam search on synthetic models of real shapes, each beside the
bound the measured bandwidths allow; speculative: `--speculative` (auto and fixed draft lengths against plain
decoding, an oracle draft at set acceptances) and `--model/--draft/--prompts` (a real head's acceptance and speed);
llamacpp: `--engine llama.cpp`, the same shapes written as GGUF files (synthetic_gguf) through the llama.cpp engine.
"""
