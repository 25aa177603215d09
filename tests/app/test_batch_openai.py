"""OpenAI Batch API files through `moedesk batch`: request lines mapped onto batch lines, output lines that the
official openai client's types read as chat and text completions, resume by custom_id, and greedy replies equal
to transformers' on a tiny model."""
import re

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion

from moedesk.app.batch import BatchSettings
from moedesk.app.batch_openai import output, to_line, written
from moedesk.app.cli import main
from moedesk.engine.runtime import Engine
from tests.app.test_batch_runner import FakeEngine, FakeTokenizer, batch, read_jsonl, write_jsonl
from tests.reference import hf_greedy, hf_model

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def request(custom_id, url=CHAT, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


# --- the mapping (pure) -----------------------------------------------------------------------------------------

def test_a_chat_request_becomes_a_messages_line_with_its_sampling_fields():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    line, chat, unknown = to_line(request("a", model="gpt-4o-mini", messages=messages, max_tokens=9, temperature=0,
                                          top_p=0.5, seed=3, stop=["\n"], tools=tools, tool_choice="auto",
                                          response_format={"type": "json_object"}, reasoning_effort="low",
                                          n=1, stream=False, logprobs=False, frequency_penalty=0, user="me",
                                          my_field=1))
    assert chat and unknown == ["my_field"]
    assert line == {"id": "a", "messages": messages, "max_new_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3,
                    "stop": ["\n"], "response_format": {"type": "json_object"}, "tools": tools,
                    "tool_choice": "auto", "reasoning_effort": "low"}
    # max_completion_tokens is the newer name and wins, as the server reads them
    assert to_line(request("a", messages=messages, max_tokens=9, max_completion_tokens=4))[0]["max_new_tokens"] == 4


@pytest.mark.parametrize("prompt, fields", [
    ("Once", {"prompt": "Once"}),
    (["Once"], {"prompt": "Once"}),
    ([5, 6, 7], {"prompt_ids": [5, 6, 7]}),
    ([[5, 6]], {"prompt_ids": [5, 6]}),
])
def test_a_text_request_takes_one_prompt_as_text_or_token_ids(prompt, fields):
    line, chat, _ = to_line(request("t", TEXT, prompt=prompt, max_tokens=3))
    assert not chat and line == {"id": "t", **fields, "max_new_tokens": 3}


@pytest.mark.parametrize("obj, words", [
    ({"custom_id": "", "url": CHAT, "body": {}}, "custom_id must be a non-empty string"),
    ({"custom_id": 7, "url": CHAT, "body": {}}, "custom_id must be a non-empty string"),
    ({**request("a"), "method": "GET"}, "method must be POST"),
    (request("a", "/v1/embeddings", input="x"), "url must be one of /v1/chat/completions, /v1/completions"),
    ({"custom_id": "a", "url": CHAT, "body": "hi"}, "body must be a JSON object"),
    (request("a", n=2, messages=[]), "body.n 2 is not supported by moedesk batch (only 1)"),
    (request("a", stream=True, messages=[]), "body.stream True is not supported"),
    (request("a", logprobs=True, messages=[]), "body.logprobs True is not supported"),
    (request("a", presence_penalty=0.5, messages=[]), "body.presence_penalty 0.5 is not supported"),
    (request("a", TEXT, prompt=["one", "two"]), "body.prompt must be one text or one list of token ids"),
    (request("a", TEXT, prompt=[True, 2]), "body.prompt must be one text or one list of token ids"),
    (request("a", TEXT, prompt="x", tools=[{"type": "function"}]), "body.tools needs url /v1/chat/completions"),
])
def test_what_cannot_run_is_named(obj, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        to_line(obj)


def test_an_output_line_reads_back_as_what_it_says():
    record = {"id": "a", "text": "", "token_ids": [1], "finish_reason": "stop", "stats": {},
              "usage": {"prompt_tokens": 2, "completion_tokens": 1},
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    line = output("a", record, True, "m")
    assert written(line) == ("a", True, "")
    message = ChatCompletion.model_validate(line["response"]["body"]).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content is None
    assert message.message.tool_calls[0].function.name == "f"
    failed = output("b", {"id": "b", "error": "line 3: empty prompt"}, True, "m")
    assert failed["response"] is None and written(failed) == ("b", False, "line 3: empty prompt")


# --- through the runner (a fake engine) -------------------------------------------------------------------------

def test_a_file_for_openai_runs_as_it_is_and_resumes_by_custom_id(tmp_path):
    lines = [
        request("chat", messages=[{"role": "user", "content": "abc"}], model="gpt-4o", max_tokens=2, stop="zz"),
        request("text", TEXT, prompt="hello", max_completion_tokens=3, weird=1),
        request("bad", "/v1/embeddings", input="x"),
        {"id": "plain", "prompt": "mixed in"},
    ]
    engine = FakeEngine()
    engine.name = "fake-moe"
    code, records, _, err = batch(tmp_path, lines, engine=engine)
    assert code == 1  # one line failed
    assert [r.get("custom_id", r.get("id")) for r in records] == ["chat", "text", "bad", "plain"]
    chat, text, bad, plain = records
    body = ChatCompletion.model_validate(chat["response"]["body"])
    assert chat["response"]["status_code"] == 200 and chat["error"] is None and chat["id"].startswith("batch_req_")
    assert body.object == "chat.completion" and body.model == "fake-moe"
    assert body.usage.completion_tokens == 2 and body.choices[0].finish_reason == "length"
    assert body.usage.total_tokens == body.usage.prompt_tokens + 2
    reply = OpenAICompletion.model_validate(text["response"]["body"])
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 3
    assert reply.choices[0].text == FakeTokenizer().decode(text["response"]["body"]["moedesk"]["token_ids"])
    assert bad["response"] is None and bad["error"]["message"].startswith("line 3: url must be one of")
    assert "text" in plain and "custom_id" not in plain  # a plain line keeps moedesk's own output
    params = {r.tag: r.params for r in engine.requests}
    assert params[1].max_new_tokens == 2 and params[1].stop == ("zz",) and params[2].max_new_tokens == 3
    assert 'line 2: field "body.weird" is not one moedesk batch uses, ignored' in err
    # A rerun skips every custom_id written, the failed one included, and writes nothing more.
    again, records_again, engine_again, _ = batch(tmp_path, lines, engine=FakeEngine())
    assert records_again == records and engine_again.requests == [] and again == 1


@pytest.mark.parametrize("line, words", [
    ({"id": "s", "prompt": "x", "stop": 5}, "stop must be a string or a list of at most 32 strings"),
    ({"id": "s", "prompt": "x", "stop": [""]}, "stop strings must have 1 to 256 characters"),
    ({"id": "s", "prompt": "x", "stop": "\n", "beams": 2}, "stop cannot be combined with beam search"),
])
def test_a_batch_line_takes_stop_strings_checked_as_the_servers(tmp_path, line, words):
    code, [record], _, _ = batch(tmp_path, [line], settings=BatchSettings(temperature=0))
    assert code == 1 and record["error"] == f"line 1: {words}"


# --- a real tiny model -------------------------------------------------------------------------------------------

def test_openai_lines_reply_as_plain_lines_and_transformers_do(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    prompt = "The quick brown fox jumps over the lazy"
    messages = [{"role": "user", "content": "Hi"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        request("text", TEXT, prompt=prompt, max_tokens=8, temperature=0),
        request("chat", messages=messages, max_tokens=8, temperature=0),
        {"id": "plain-chat", "messages": messages, "max_new_tokens": 8, "temperature": 0},
    ])
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(src), "-o", str(out), "--model", str(folder), "--device", "cpu", "--dtype", "float32",
                 "--batch-size", "2"]) == 0
    text, chat, plain = read_jsonl(out)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    text_body = OpenAICompletion.model_validate(text["response"]["body"])
    ids = text["response"]["body"]["moedesk"]["token_ids"]
    assert ids == hf_greedy(hf_model(folder), engine.tokenizer.encode(prompt), 8, eos)
    assert text_body.choices[0].text == engine.tokenizer.decode(ids)
    chat_body = ChatCompletion.model_validate(chat["response"]["body"])
    assert chat["response"]["body"]["moedesk"]["token_ids"] == plain["token_ids"]
    assert chat_body.choices[0].message.content == plain["text"] and chat["custom_id"] == "chat"
