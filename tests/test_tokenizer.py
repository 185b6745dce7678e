"""Tokenizer tests against transformers' references (tests/oracle/smollm2_references.json).

The references come from tests/oracle/make_references.py, run with transformers in a separate venv: the
SmolLM2 GGUF tokenized and templated by transformers, a small SentencePiece vocabulary converted by its
GGUF code, and other chat templates rendered by its jinja environment.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mlx_infer.chat_template import render_chat
from mlx_infer.errors import InvalidCheckpoint, InvalidRequest
from mlx_infer.tokenizer import Tokenizer

REFS = json.loads((Path(__file__).parent / "oracle" / "smollm2_references.json").read_text(encoding="utf-8"))
MULTILINGUAL = [
    "Grüße aus Zürich! Ça va? 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "你好，世界！日本語のテキスト。한국어 텍스트",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "def f(x):\n\treturn x ** 2  # ∑ x² ≤ ∞\n\n\n   indented",
]


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    _, meta = mx.load(str(smollm2_path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(REFS["sentencepiece"]["metadata"])


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.flush()]


def assert_streams_like_decode(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> None:
    """Every prefix: the pieces emitted so far, plus flush, equal the full decode of that prefix."""
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    emitted = ""
    for n, token in enumerate(ids, 1):
        piece = detok.add(token)
        assert "\ufffd" not in piece or "\ufffd" in tok.decode(ids[:n], skip_special_tokens), piece
        emitted += piece
        full = tok.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        assert full.startswith(emitted), (ids[:n], emitted, full)
    emitted += detok.flush()
    assert emitted == tok.decode(ids, skip_special_tokens=skip_special_tokens)


# ------------------------------------------------------------------ SmolLM2 GGUF against transformers
def test_gguf_special_tokens(smol: Tokenizer):
    special = REFS["special"]
    assert smol.bos_token_id == special["bos_token_id"]
    assert smol.eos_token_id == special["eos_token_id"]
    assert smol.pad_token_id == special["pad_token_id"]
    assert smol.vocab_size == special["vocab_size"]
    assert smol.special_tokens == REFS["special_tokens_map"]
    assert smol.eos_token_ids == {special["eos_token_id"]}  # <|im_end|> is both eos and the turn end


@pytest.mark.parametrize("case", REFS["encode"], ids=lambda c: repr(c["text"][:24]))
def test_gguf_encode_decode_match_transformers(smol: Tokenizer, case: dict):
    assert smol.encode(case["text"]) == case["ids"]
    assert smol.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]
    assert smol.decode(case["ids"]) == case["decoded"]


@pytest.mark.parametrize("case", REFS["chat_templates"], ids=lambda c: c["name"])
def test_gguf_chat_template_matches_transformers(smol: Tokenizer, case: dict):
    rendered = smol.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                        tools=case["tools"])
    assert rendered == case["rendered"]


@pytest.mark.parametrize("case", REFS["generations"], ids=lambda c: c["name"])
def test_prompt_ids_match_transformers(smol: Tokenizer, case: dict):
    """Rendered prompt encoded without added specials == transformers' apply_chat_template(tokenize=True)."""
    text = smol.apply_chat_template(case["messages"], add_generation_prompt=True)
    assert text == case["prompt_text"]
    assert smol.encode(text, add_special_tokens=False) == case["prompt_ids"]
    assert smol.encode_chat(case["messages"]) == case["prompt_ids"]
    # The model's greedy output streams to the same text as a full decode.
    assert "".join(stream(smol, case["output_ids"], skip_special_tokens=True)) == case["output_text"]


def test_detokenizer_every_prefix_multilingual(smol: Tokenizer):
    for text in MULTILINGUAL:
        ids = smol.encode(text)
        assert_streams_like_decode(smol, ids)
        # Byte-level BPE splits emoji and CJK characters over tokens: some steps must hold text back.
        assert "" in stream(smol, ids)[:-1] or text.isascii()


def test_detokenizer_random_ids(smol: Tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert_streams_like_decode(smol, ids, skip)


def test_detokenizer_window_stays_small(smol: Tokenizer):
    """The window is a few tokens whatever the sequence length: per-token cost does not grow."""
    ids = smol.encode(" ".join(MULTILINGUAL) * 20)
    detok = smol.detokenizer()
    longest = 0
    for token in ids:
        detok.add(token)
        longest = max(longest, len(detok._tokens))
    assert len(ids) > 1000 and longest <= 8


# ------------------------------------------------------------------ SentencePiece ("llama") GGUF vocab
@pytest.mark.parametrize("case", REFS["sentencepiece"]["encode"], ids=lambda c: repr(c["text"]))
def test_sentencepiece_gguf_matches_transformers(sentencepiece: Tokenizer, case: dict):
    assert sentencepiece.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]
    assert sentencepiece.decode(case["ids_no_special"]) == case["decoded"]
    # llama.cpp (and transformers) add BOS to SentencePiece vocabularies that do not say otherwise.
    assert sentencepiece.encode(case["text"]) == [1] + case["ids_no_special"]


def test_sentencepiece_detokenizer_byte_fallback(sentencepiece: Tokenizer):
    for case in REFS["sentencepiece"]["encode"]:
        assert_streams_like_decode(sentencepiece, case["ids_no_special"])
    # A character made of <0xNN> tokens comes out whole once its byte run ends (a later byte could still
    # turn the run invalid, and ByteFallback then decodes every byte of it to U+FFFD).
    ids = sentencepiece.encode("日!", add_special_tokens=False)  # ▁ <0xE6> <0x97> <0xA5> !
    assert len(ids) == 5 and stream(sentencepiece, ids) == ["", "", "", "", "日!", ""]
    assert stream(sentencepiece, ids[:4]) == ["", "", "", "", "日"]
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(sentencepiece.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert_streams_like_decode(sentencepiece, ids, skip)


def test_token_bytes_of_the_pieces_of_a_character(smol: Tokenizer, sentencepiece: Tokenizer):
    # Byte-level BPE: an emoji or a CJK character split across tokens, each piece's own bytes.
    text = "🎉 Café 日本語 naïve <|im_end|>"
    ids = smol.encode(text, add_special_tokens=False)
    assert any("\ufffd" in smol.decode([i]) for i in ids)  # (some token is a piece of a character)
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8")
    # SentencePiece byte fallback: <0xNN> is the byte NN.
    ids = sentencepiece.encode("日!", add_special_tokens=False)  # ▁ <0xE6> <0x97> <0xA5> !
    assert [sentencepiece.token_bytes(i) for i in ids[1:4]] == [b"\xe6", b"\x97", b"\xa5"]


# ------------------------------------------------------------------ templates (transformers' jinja env)
@pytest.mark.parametrize("case", REFS["extra_templates"], ids=lambda c: c["name"])
def test_templates_render_like_transformers(case: dict):
    rendered = render_chat(case["template"], case["messages"], special_tokens=REFS["special_tokens_map"],
                           add_generation_prompt=case["add_generation_prompt"], tools=case["tools"],
                           **case["kwargs"])
    assert rendered == case["rendered"]


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutating the caller's data
])
def test_template_sandbox_escapes_raise(template: str):
    with pytest.raises(InvalidRequest):
        render_chat(template, [{"role": "user", "content": "hi"}], special_tokens={})


def test_template_unsafe_attribute_renders_nothing():
    assert render_chat("{{ ''.__class__ }}", [{"role": "user", "content": "x"}], special_tokens={}) == ""


def test_raise_exception_is_invalid_request():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}" \
               "{% endif %}"
    with pytest.raises(InvalidRequest, match="first message must be user"):
        render_chat(template, [{"role": "system", "content": "x"}], special_tokens={})


def test_template_syntax_error_is_invalid_checkpoint():
    with pytest.raises(InvalidCheckpoint):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}], special_tokens={})


def test_template_helpers():
    template = "{{ strftime_now('%Y') | length }}|{% generation %}{{ messages[0].content }}" \
               "{% endgeneration %}|{{ {'k': '<é>'} | tojson }}"
    assert render_chat(template, [{"role": "user", "content": "x", "tool_calls": None}],
                       special_tokens={}) == '4|x|{"k": "<é>"}'


# ------------------------------------------------------------------ Hugging Face folders
def _bpe_backend() -> HFTokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for piece in ("he", "ll", "llo", "Ġw", "or", "ld"):
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("Ġ", "w"), ("o", "r"), ("l", "d")]
    tok = HFTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    return tok


def test_folder_round_trip(tmp_path: Path):
    backend = _bpe_backend()
    backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "<|im_end|>", "add_bos_token": True,
        "chat_template": template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 258]}))
    tok = Tokenizer.from_folder(tmp_path)
    text = "hello world, héllo 世界"
    assert tok.encode(text, add_special_tokens=False) == backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == [tok.bos_token_id] + backend.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_ids == {257, 258, tok.token_to_id("<|im_end|>")}
    prompt = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert prompt.count(tok.bos_token_id) == 1 and prompt[0] == tok.bos_token_id  # the template's BOS only


def test_folder_chat_template_jinja_file_and_missing_template(tmp_path: Path):
    _bpe_backend().save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_folder(tmp_path)
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_folder_without_tokenizer_json(tmp_path: Path):
    with pytest.raises(InvalidCheckpoint):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("pre, pieces", [
    ("gpt2", ["abc", "Ġ12345", "Ġ", "Ġx"]),
    ("llama-bpe", ["abc", "Ġ", "123", "45", "Ġ", "Ġx"]),  # Llama 3: digits in groups of three
    ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Ġx"]),
    ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Ġx"]),  # SmolLM's Digits(individual) split
])
def test_gguf_byte_level_pre_tokenizers(pre: str, pieces: list[str]):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": alphabet,
        "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": mx.array(0, dtype=mx.uint32),
    })
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("abc 12345  x")] == pieces
    assert tok.decode(tok.encode("abc 12345  x")) == "abc 12345  x"


@pytest.mark.parametrize("pre, pieces", [
    ("qwen2", ["cafe", "Ìģ", "Ġx"]),  # the combining acute accent (U+0301) is not a letter: split off
    ("qwen35", ["cafeÌģ", "Ġx"]),  # Qwen3.5's regex keeps marks (\p{M}) inside words
])
def test_gguf_qwen35_pre_tokenizer_keeps_combining_marks_in_words(pre: str, pieces: list[str]):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": alphabet,
        "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": mx.array(0, dtype=mx.uint32),
    })
    text = "cafe\u0301 x"
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tok.decode(tok.encode(text)) == text
