"""The llama.cpp engine: GGUF models of every architecture llama.cpp reads, behind the same `Engine` face.

library.py loads llama-cpp-python's bundled library (one line when it is missing or broken) and keeps its log;
placement.py decides which layers' experts stay in RAM and fit.py what that holds in RAM and on the GPU
(the load's check and the Models screen's line); overrides.py hands that to llama.cpp as tensor buffer
overrides; decoder.py runs the scheduler's steps through llama_batch, several sequences per call; vocab.py is
the model's own tokenizer with moedesk's sandboxed chat templates; expert_counts.py counts the routers' picks
from llama.cpp's graph (the heat map's counts); engine.py ties them together.
"""
