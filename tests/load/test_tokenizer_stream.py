"""StreamDecoder: the text of ids that arrive one at a time must be decode(ids), and it must never raise, even
where tokenizers' DecodeStream does (byte-fallback tokens, whose undecodable runs decode rewrites)."""
import random

import gguf
import numpy as np
import pytest
from tokenizers.decoders import DecodeStream

from moedesk.bench.synthetic_gguf import add_placeholder_vocabulary
from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint
from moedesk.engine.load.tokenizer import Tokenizer
from tests.tiny_models import train_tokenizer

FFFD = "\ufffd"
N, O, X_AC, T12 = 3 + 0x4E, 3 + 0x4F, 3 + 0xAC, 259 + 12  # <0x4E> "N", <0x4F> "O", <0xAC> (no character), "t12"


@pytest.fixture(scope="module")
def placeholder_gguf(tmp_path_factory):
    """A GGUF with the synthetic GGUF writer's vocabulary (SentencePiece, <0xXX> byte fallback): the GPU box's
    whole-model Mixtral file failed its first batch line on DecodeStream with this tokenizer."""
    path = tmp_path_factory.mktemp("vocab") / "placeholder.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(32)
    w.add_head_count(2); w.add_layer_norm_rms_eps(1e-5)
    add_placeholder_vocabulary(w, 400)
    w.add_tensor("token_embd.weight", np.zeros((400, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def _tokenizers(path):
    ckpt = GGUFCheckpoint(path)
    return {"placeholder-gguf": Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config),
            "byte-level-bpe": Tokenizer(train_tokenizer(), {})}


def _stream(tokenizer, ids, skip_special_tokens=True):
    """StreamDecoder's piece after each id."""
    decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
    return [decoder.step(i) for i in ids]


def test_the_token_sequence_that_broke_decodestream_streams_as_llama_cpp_spells_it(placeholder_gguf):
    tokenizer = _tokenizers(placeholder_gguf)["placeholder-gguf"]
    ids = [N, O, X_AC, T12]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):  # the failure seen on the GPU box, reproduced
        for i in ids:
            stream.step(tokenizer._tok, i)
    pieces = _stream(tokenizer, ids)
    assert pieces[:3] == ["N", "O", ""]
    # decode() turns the whole byte run N O 0xAC into three U+FFFD, rewriting the "NO" already shown; the stream
    # adds only what lies beyond it, which is the bytes' own reading (llama.cpp's, checked below).
    assert "".join(pieces) == "NO" + FFFD + "t12"
    llama_cpp = pytest.importorskip("llama_cpp")
    reference = llama_cpp.Llama(model_path=str(placeholder_gguf), vocab_only=True, verbose=False)
    assert reference.detokenize(ids).decode("utf-8", "replace") == "NO" + FFFD + "t12"


@pytest.mark.parametrize("name", ["placeholder-gguf", "byte-level-bpe"])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_pieces_add_up_to_the_tokenizers_decode_on_random_ids(placeholder_gguf, name, skip):
    """Random ids over the whole vocabulary (specials and lone bytes included) never make step() raise; after
    each id whose decode is whole text, the pieces so far are that text; where decode rewrote earlier bytes as
    U+FFFD, they differ from it only there."""
    tokenizer = _tokenizers(placeholder_gguf)[name]
    vocab = tokenizer._tok.get_vocab_size(with_added_tokens=True)
    rng = random.Random(f"{name}-{skip}")
    checked = rewritten = 0
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        pieces = _stream(tokenizer, ids, skip)
        assert all(isinstance(p, str) for p in pieces)
        for n in range(1, len(ids) + 1):
            text, shown = tokenizer.decode(ids[:n], skip_special_tokens=skip), "".join(pieces[:n])
            if text.endswith(FFFD):
                continue  # a character still split over byte tokens: nothing to compare yet
            if FFFD not in text:
                assert shown == text, (ids[:n], pieces[:n])
                checked += 1
            else:
                assert len(shown) == len(text), (ids[:n], pieces[:n], text)
                assert all(a == b or FFFD in (a, b) for a, b in zip(shown, text)), (ids[:n], pieces[:n], text)
                rewritten += 1
    assert checked > 500  # the comparison ran on many prefixes, not only on the rewritten ones
    if name == "placeholder-gguf":
        assert rewritten > 50  # and the fallback path was exercised


@pytest.mark.parametrize("name", ["placeholder-gguf", "byte-level-bpe"])
def test_stream_of_encoded_text_is_the_text(placeholder_gguf, name):
    tokenizer = _tokenizers(placeholder_gguf)[name]
    for text in ["hello world", "naïve 日本語 🙂 ok", "a\n\n  b", "t1t2 <0x41>"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_after_a_fallback_the_stream_keeps_going(placeholder_gguf):
    """Fallbacks one after another, then the fast path again, through a character split over two byte tokens."""
    tokenizer = _tokenizers(placeholder_gguf)["placeholder-gguf"]
    ids = [N, O, X_AC, T12, X_AC, 259 + 5, 3 + 0xC3, 3 + 0xA9, 259 + 7, 259 + 8]
    assert "".join(_stream(tokenizer, ids)) == "NO" + FFFD + "t12" + FFFD + "t5ét7t8"
    llama_cpp = pytest.importorskip("llama_cpp")
    reference = llama_cpp.Llama(model_path=str(placeholder_gguf), vocab_only=True, verbose=False)
    assert reference.detokenize(ids).decode("utf-8", "replace") == "NO" + FFFD + "t12" + FFFD + "t5ét7t8"


def test_the_fallback_needs_no_decodestream_prefill_and_returns_to_the_window(placeholder_gguf, monkeypatch):
    """tokenizers 0.21 (pyproject's floor) has DecodeStream(skip_special_tokens) alone, no `ids` to start from: the
    fallback still streams the same text and the fast path takes over again after it."""
    from moedesk.engine.load import tokenizer as module

    real = module.DecodeStream
    monkeypatch.setattr(module, "DecodeStream",
                        lambda skip_special_tokens=False: real(skip_special_tokens=skip_special_tokens))
    tokenizer = _tokenizers(placeholder_gguf)["placeholder-gguf"]
    ids = [N, O, X_AC, T12, X_AC, 259 + 5, 3 + 0xC3, 3 + 0xA9, 259 + 7, 259 + 8]
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.step(i) for i in ids) == "NO" + FFFD + "t12" + FFFD + "t5ét7t8"
    assert decoder._stream is not None  # the window again, not a full decode for every id from the first fallback


def test_an_engine_stream_of_byte_tokens_keeps_every_character(tmp_path):
    """Engine.stream (what the chat screen and the server's streams read) on the synthetic GGUF writer's model,
    random weights answering in byte runs DecodeStream cannot stream: the chunks are the reply's text, up to
    the bytes the whole decode rewrote as U+FFFD, and the last chunk brings what was still pending."""
    from moedesk.bench.synthetic_gguf import write_f16
    from moedesk.engine.load.synthetic import shape_config
    from moedesk.engine.requests import SamplingParams
    from moedesk.engine.runtime import Engine

    model = tmp_path / "tiny-moe.gguf"
    write_f16(shape_config("tiny-moe", 2), model)
    engine = Engine.load(str(model), device="cpu", dtype="float32")
    try:
        for seed in range(3):
            chunks = list(engine.stream(engine.tokenizer.encode("Hello there"),
                                        SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)))
            completion = chunks[-1].completion
            shown = "".join(c.text for c in chunks)
            assert completion.text == engine.tokenizer.decode(completion.token_ids) and FFFD in completion.text
            assert len(shown) == len(completion.text)
            assert all(a == b or FFFD in (a, b) for a, b in zip(shown, completion.text))
    finally:
        engine.scheduler.close()
