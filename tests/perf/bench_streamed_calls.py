"""What streaming tool calls in fragments costs `moedesk serve`: N concurrent streamed chat requests forced to call a
function (tool_choice "required": the grammar holds the reply to a JSON list of calls, and the server reads each
call's arguments as they are written, per token, on its event loop), against the same requests held by the same
JSON schema as a response_format (the same grammar work, no call reading).

Usage (against a running server, e.g. `moedesk serve --model CKPT --model-name bench --port 8123` on the GPU box
with tests/perf/make_mixtral_checkpoint.py's checkpoint):
    python3 tests/perf/bench_streamed_calls.py --url http://127.0.0.1:8123 [--model bench] [--clients 16]
        [--max-tokens 256] [--rounds 3]

Prints, for each kind, completion tokens per second over all clients (from each stream's usage) and the number of
argument fragments the calls came in; then the ratio. CPU or GPU: the server decides.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

CODE = {"type": "function", "function": {"name": "python", "description": "Run Python code", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"], "additionalProperties": False}}}
CALLS_SCHEMA = {"type": "array", "minItems": 1, "maxItems": 1, "items": {
    "type": "object", "properties": {"name": {"const": "python"}, "arguments": CODE["function"]["parameters"]},
    "required": ["name", "arguments"], "additionalProperties": False}}  # what tool_choice "required" is held to


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, int]:
    """(completion tokens, argument fragments) of one streamed request."""
    tokens = fragments = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                fragments += sum(1 for c in choice["delta"].get("tool_calls") or () if c["function"].get("arguments"))
    return tokens, fragments


async def run(url: str, body: dict, clients: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, {**body, "seed": i}) for i in range(clients)))
        elapsed = time.perf_counter() - started
    return sum(t for t, _ in results) / elapsed, sum(f for _, f in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8123")
    parser.add_argument("--model", default="bench")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ask = [{"role": "user", "content": "Write a long Python program."}]
    base = {"model": args.model, "messages": ask, "max_tokens": args.max_tokens, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    kinds = {"forced calls, arguments streamed": {**base, "tools": [CODE], "tool_choice": "required",
                                                  "parallel_tool_calls": False},
             "the same schema as a response_format": {**base, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "calls", "schema": CALLS_SCHEMA}}}}
    rates = {}
    for name, body in kinds.items():
        runs = [asyncio.run(run(args.url, body, args.clients)) for _ in range(args.rounds)]
        rates[name] = max(rate for rate, _ in runs)
        print(f"{name}: {rates[name]:.1f} tok/s over {args.clients} clients (best of {args.rounds}), "
              f"{runs[-1][1]} argument fragments")
    calls, plain = rates.values()
    print(f"ratio: {calls / plain:.3f}")


if __name__ == "__main__":
    main()
