"""The remote engine: generation on an OpenAI-compatible server, the tokenizer and chat template kept here."""
