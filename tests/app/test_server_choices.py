"""OpenAI's `n` through the official client: several choices of one request, plain and streamed, each sampled as a
request of its own would be (choice i with seed + i)."""
import pytest

from tests.app.test_server import KEY, client, engine, running_server, url, wait_idle  # noqa: F401

HI = [{"role": "user", "content": "Tell me a story"}]
COMMON = dict(model="tiny", max_tokens=8, temperature=1.0)


def test_each_choice_is_the_reply_its_own_seed_gives(client):
    reply = client.chat.completions.create(messages=HI, n=3, seed=11, **COMMON)
    alone = [client.chat.completions.create(messages=HI, seed=11 + i, **COMMON) for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in reply.choices}) > 1  # sampled apart, not one reply copied
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_text_completions_take_n_too(client):
    reply = client.completions.create(prompt="Once upon a time", n=2, seed=3, **COMMON)
    alone = [client.completions.create(prompt="Once upon a time", seed=3 + i, **COMMON).choices[0].text
             for i in range(2)]
    assert [c.text for c in reply.choices] == alone and [c.index for c in reply.choices] == [0, 1]


def test_streamed_choices_interleave_and_end_with_their_usage(client, url):
    plain = client.chat.completions.create(messages=HI, n=2, seed=5, **COMMON)
    chunks = list(client.chat.completions.create(messages=HI, n=2, seed=5, stream=True,
                                                 stream_options={"include_usage": True}, **COMMON))
    text, finish, roles = {0: "", 1: ""}, {}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        text[choice.index] += choice.delta.content or ""
        roles.setdefault(choice.index, choice.delta.role)
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert text == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices} and roles == {0: "assistant", 1: "assistant"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    wait_idle(url)  # both rows freed


def test_more_choices_than_the_queue_holds_is_503_and_frees_the_ones_started(engine):
    import httpx

    with running_server(engine, api_key=KEY, batch_size=1, max_queue=2, model_name="tiny") as base:
        body = {"messages": HI, "n": 4, **COMMON}
        r = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        wait_idle(base)
        r = httpx.post(base + "/v1/chat/completions", json={**body, "n": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


@pytest.mark.parametrize("n", [1, 2])
def test_greedy_choices_are_the_greedy_reply(client, n):
    greedy = dict(COMMON, temperature=0)
    reply = client.chat.completions.create(messages=HI, n=n, **greedy)
    one = client.chat.completions.create(messages=HI, **greedy).choices[0].message.content
    assert [c.message.content for c in reply.choices] == [one] * n
