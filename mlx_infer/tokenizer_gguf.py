"""Build a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary. The two common kinds map
onto ``tokenizers`` models the way transformers' GGUF loader maps them (so both agree token for token):
- ``gpt2``: byte-level BPE; vocabulary and merges from the file, the split regex from ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece BPE with byte fallback; merges are recovered from the token scores, spaces are
  ``▁`` (Metaspace), a prefix space is added when ``add_space_prefix`` says so.
- ``gemma4`` (Gemma 4): SentencePiece-style BPE with byte fallback over raw UTF-8, merges from the file,
  spaces ``▁`` (no prefix space), text split only into newline runs and the rest, as llama.cpp reads it.
Control tokens (token type 3) become special added tokens, user-defined ones (type 4) plain added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from mlx_infer.errors import UnsupportedArchitecture

CONTROL, USER_DEFINED = 3, 4

# Split regexes of llama.cpp's pre-tokenizer types, as the models' own tokenizer.json files spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
}
# Pre-tokenizer types that split every digit apart before the GPT-2 regex (SmolLM's tokenizer.json does
# this with a Digits pre-tokenizer; llama.cpp with a leading \p{N} regex).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell"}
_GEMMA4_END_TOKENS = ("<turn|>", "<|tool_response>")  # end of a turn, and of a turn that calls a tool


@dataclass
class GGUFVocab:
    """What the tokenizer needs besides the ``tokenizers`` object."""

    backend: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token -> their text
    eos_token_ids: set[int] = field(default_factory=set)  # eos plus llama.cpp's eot/eom ids
    chat_template: str | dict[str, str] | None = None


def _value(v: Any) -> Any:
    """Metadata values from ``mx.load(..., return_metadata=True)`` are str, list or mx.array."""
    return v.tolist() if hasattr(v, "tolist") else v


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet byte-level BPE vocabularies use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from the vocabulary: every split of a token into two tokens is a merge,
    ranked by the merged token's score (transformers' ``generate_merges``, so the ranks agree)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict, tokens: list[str]) -> tuple[Tokenizer, set[str]]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet is a llama.cpp quirk; respell it byte by byte as transformers does.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}  # a duplicate maps to its last id, as in llama.cpp
    merges = [tuple(m.split(" ")) for m in _value(meta.get("tokenizer.ggml.merges", []))]
    backend = Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    pre = _value(meta.get("tokenizer.ggml.pre", "default"))
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "default", "gpt2" and unknown types: GPT-2's own regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend, alphabet


def _sentencepiece(meta: dict, tokens: list[str], unk: str | None) -> Tokenizer:
    scores = _value(meta.get("tokenizer.ggml.scores")) or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, _merges_from_scores(tokens, scores), unk_token=unk, fuse_unk=True,
                     byte_fallback=True, dropout=None)
    backend = Tokenizer(bpe)
    prefix_space = bool(_value(meta.get("tokenizer.ggml.add_space_prefix", True)))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _gemma4(meta: dict, tokens: list[str], unk: str | None) -> Tokenizer:
    """llama.cpp's ``gemma4`` vocabulary: spaces become ``▁``, the text is cut into runs of newlines and
    the text between them, and the file's merges run over each piece's UTF-8 characters (bytes outside
    the vocabulary fall back to ``<0xXX>``). A piece the vocabulary holds whole is that token without
    merging (llama.cpp's rule for newline runs, which hold the only such pieces in practice)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp cuts a merge at its first space after the first character.
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in _value(meta["tokenizer.ggml.merges"])]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                                   dropout=None, ignore_merges=True))  # fmt: skip
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Add BOS and/or EOS (text, id) around each sequence, as transformers' ``update_post_processor``."""

    def seq(name: str, type_id: int) -> str:
        parts = ([f"{bos[0]}:{type_id}"] if bos else []) + [f"${name}:{type_id}"]
        return " ".join(parts + ([f"{eos[0]}:{type_id}"] if eos else []))

    return processors.TemplateProcessing(single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
                                         special_tokens=[t for t in (bos, eos) if t])


def build_gguf_vocab(meta: dict) -> GGUFVocab:
    """Build the tokenizer that ``meta`` (the metadata dict ``mx.load(..., return_metadata=True)`` returns)
    describes. Raises ``UnsupportedArchitecture`` for vocabulary kinds other than gpt2 and llama."""
    kind = _value(meta.get("tokenizer.ggml.model"))
    tokens = _value(meta.get("tokenizer.ggml.tokens"))
    if not tokens:
        raise UnsupportedArchitecture("GGUF file has no tokenizer.ggml.tokens: cannot build its tokenizer")
    token_types = _value(meta.get("tokenizer.ggml.token_type")) or [1] * len(tokens)

    def token_at(key: str) -> tuple[str, int] | None:
        idx = _value(meta.get(f"tokenizer.ggml.{key}"))
        return (tokens[idx], idx) if idx is not None and 0 <= idx < len(tokens) else None

    named = {"bos_token": token_at("bos_token_id"), "eos_token": token_at("eos_token_id"),
             "unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")}
    if kind == "gpt2":
        backend, alphabet = _byte_level(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend, alphabet = _sentencepiece(meta, tokens, named["unk_token"] and named["unk_token"][0]), None
        add_bos_default = True  # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise
    elif kind == "gemma4":
        backend, alphabet = _gemma4(meta, tokens, named["unk_token"] and named["unk_token"][0]), None
        add_bos_default = True
    else:
        raise UnsupportedArchitecture(
            f"GGUF tokenizer model {kind!r} is not supported (only gpt2, llama and gemma4)"
        )

    # Control tokens must match whole in text, never be cut into pieces. In a byte-level vocabulary a
    # "control" token spelled outside the byte alphabet is mislabelled and skipped, like transformers does.
    control = [t for t, ty in zip(tokens, token_types)
               if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    control += [t for t, _ in filter(None, named.values()) if t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, token_types)
            if ty == USER_DEFINED and backend.token_to_id(t) is not None]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    add_bos = bool(_value(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)))
    add_eos = bool(_value(meta.get("tokenizer.ggml.add_eos_token", False)))
    backend.post_processor = bos_eos_post_processor(named["bos_token"] if add_bos else None,
                                                    named["eos_token"] if add_eos else None)

    eos_ids = {t[1] for t in (named["eos_token"], token_at("eot_token_id"), token_at("eom_token_id")) if t}
    if kind == "gemma4":  # llama.cpp ends generation at these too (Gemma 4's generation_config lists them)
        eos_ids |= {i for i, t in enumerate(tokens) if t in _GEMMA4_END_TOKENS}
    templates = {k.removeprefix("tokenizer.chat_template.") or "default": _value(v)
                 for k, v in meta.items() if k.startswith("tokenizer.chat_template.")}
    default = _value(meta.get("tokenizer.chat_template"))
    if templates and default:
        templates["default"] = default
    return GGUFVocab(
        backend=backend,
        special_tokens={name: t[0] for name, t in named.items() if t},
        eos_token_ids=eos_ids,
        chat_template=templates or default,
    )
