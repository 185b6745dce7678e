"""The tokenizer: ``tokenizers`` for text <-> ids, chat templates, incremental detokenization.

Built from a Hugging Face folder (tokenizer.json + tokenizer_config.json + generation_config.json) or from
GGUF metadata. Behaviour follows transformers, the reference every model's files were made for.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers

from mlx_infer.chat_template import render_chat, select_template
from mlx_infer.detokenizer import IncrementalDetokenizer
from mlx_infer.errors import InvalidCheckpoint, InvalidRequest
from mlx_infer.tokenizer_gguf import bos_eos_post_processor, build_gguf_vocab, bytes_to_unicode
from mlx_infer.tokenizer_tiktoken import is_kimi_folder, kimi_backend

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# Tokens that end a turn in common chat templates. The model stops on them even where the files name a
# different eos (SmolLM's <|endoftext|>, Llama 3's <|end_of_text|>), so they join eos_token_ids when the
# template uses them.
_TURN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "</s>",
)
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        self.eos_token_ids: set[int] = {i for i in extra_eos_token_ids if i is not None}
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        for text in self._template_turn_ends():
            self.eos_token_ids.add(self._backend.token_to_id(text))
        # <0xNN> tokens only need holding back where the model falls back to bytes (SentencePiece BPE).
        byte_fallback = getattr(backend.model, "byte_fallback", False)
        self._byte_token_ids = frozenset(self._byte_fallback_ids()) if byte_fallback else frozenset()

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and chat_template.jinja."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        config = _read_json(folder / "tokenizer_config.json")
        if not tok_file.is_file() and is_kimi_folder(folder, config):
            backend = kimi_backend(folder, config)  # a tiktoken rank file instead (Kimi K2)
        elif not tok_file.is_file():
            raise InvalidCheckpoint(f"no tokenizer.json in {folder}")
        else:
            try:
                backend = tokenizers.Tokenizer.from_file(str(tok_file))
            except Exception as e:  # tokenizers raises plain Exception on malformed files
                raise InvalidCheckpoint(f"cannot read {tok_file}: {e}") from e
        special = {name: _token_text(config.get(name)) for name in _NAMED_SPECIAL}
        for name, value in _read_json(folder / "special_tokens_map.json").items():
            if name in _NAMED_SPECIAL and special.get(name) is None:
                special[name] = _token_text(value)
        special = {k: v for k, v in special.items() if v is not None}

        # Like transformers: an explicit add_bos_token/add_eos_token (or a tokenizer.json without a
        # post-processor) rebuilds the post-processor; otherwise tokenizer.json's own is kept.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:

            def named(name: str, flag: str) -> tuple[str, int] | None:
                text = special.get(name)
                tid = backend.token_to_id(text) if text and config.get(flag) else None
                return (text, tid) if tid is not None else None

            backend.post_processor = bos_eos_post_processor(
                named("bos_token", "add_bos_token"), named("eos_token", "add_eos_token")
            )

        template: Any = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}] as transformers saves named ones
            template = {t["name"]: t["template"] for t in template}
        if (folder / "chat_template.jinja").is_file():  # newer transformers save the template beside
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(folder / "chat_template.json").get("chat_template")

        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        return cls(backend, special_tokens=special, chat_template=template, extra_eos_token_ids=extra)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from the metadata dict of ``mx.load(path, return_metadata=True)``."""
        vocab = build_gguf_vocab(dict(meta))
        return cls(
            vocab.backend,
            special_tokens=vocab.special_tokens,
            chat_template=vocab.chat_template,
            extra_eos_token_ids=vocab.eos_token_ids,
        )

    # ----------------------------------------------------------------------------------------- text
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS where the model's files ask for it."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for. Its text alone may be no whole character (one of the tokens
        an emoji or a CJK character is split into decodes to U+FFFD): then its bytes are read from the
        vocabulary, a byte-level BPE token's characters each standing for one byte (GPT-2's map) and a
        SentencePiece fallback token ``<0xNN>`` for the byte NN."""
        text = self.decode([token_id])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        token = self._backend.id_to_token(token_id) or ""
        if token_id in self._byte_token_ids:
            return bytes([int(token[3:5], 16)])
        if isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
            byte_of = _byte_level_bytes()
            if all(c in byte_of for c in token):
                return bytes(byte_of[c] for c in token)
        return text.encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._backend, skip_special_tokens=skip_special_tokens, byte_token_ids=self._byte_token_ids
        )

    # ----------------------------------------------------------------------------------------- chat
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, tools: list | None = None, **kwargs: Any
    ) -> str:
        """The prompt text of ``messages``, as transformers' ``apply_chat_template(tokenize=False)``."""
        template = select_template(self.chat_template, tools)
        return render_chat(
            template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )

    def encode_chat(
        self, messages: Any, add_generation_prompt: bool = True, tools: list | None = None, **kwargs: Any
    ) -> list[int]:
        """Prompt ids of a conversation. The template writes any BOS itself, so none is added here (as
        transformers' ``apply_chat_template(tokenize=True)``)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # ----------------------------------------------------------------------------------------- helpers
    def _id_of(self, text: str | None) -> int | None:
        return self._backend.token_to_id(text) if text else None

    def _template_turn_ends(self) -> list[str]:
        templates = self.chat_template
        if templates is None:
            return []
        sources = [templates] if isinstance(templates, str) else list(templates.values())
        return [
            t
            for t in _TURN_END_TOKENS
            if any(t in s for s in sources) and self._backend.token_to_id(t) is not None
        ]

    def _byte_fallback_ids(self) -> Iterable[int]:
        for b in range(256):
            tid = self._backend.token_to_id(f"<0x{b:02X}>")
            if tid is not None:
                yield tid


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """Byte-level BPE's character -> byte: GPT-2's map (``bytes_to_unicode``), inverted."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidCheckpoint(f"cannot read {path}: {e}") from e


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
