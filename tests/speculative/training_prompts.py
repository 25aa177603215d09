"""Chat prompts written here (never taken from an evaluation set) for the train-draft tests, and their file."""
import json

PROMPTS = ["Hello, world!", "Tell me about the quick brown fox.", "def add(a, b):", "How do experts route tokens?",
           "Write a list of numbers.", "What is 2 + 3?"]


def write_prompts(path, extra=()):
    """PROMPTS as train-draft's JSONL (one chat per line), then the records in `extra` as they are."""
    lines = [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS] + list(extra)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
