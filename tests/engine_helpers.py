"""Tiny models and a stand-in tokenizer for engine tests (no real weights needed)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading.policy import prepare_for_backend
from mlx_infer.models import model_module


class CharTokenizer:
    """Token t decodes to ``chr(97 + t % 26)``; token 0 is EOS."""

    vocab_size = 64
    eos_token_ids = {0}
    bos_token_id = None

    class _Detok:
        def add(self, token: int) -> str:
            return chr(97 + token % 26)

        def flush(self) -> str:
            return ""

    def detokenizer(self):
        return self._Detok()

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def tiny_llama(seed: int = 0, layers: int = 2):
    mx.random.seed(seed)
    module = model_module("llama")
    args = module.ModelArgs.from_dict(
        dict(
            model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=CharTokenizer.vocab_size,
            max_position_embeddings=512,
        )
    )
    model = module.Model(args)
    # Scale weights up so greedy paths are not all one token.
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    prepare_for_backend(model)  # as the loader leaves every model it loads
    return model


def full_forward_logits(model, tokens: list[int]) -> mx.array:
    """Logits of the last position from one uncached forward over ``tokens`` (the oracle)."""
    bs = 16
    blocks = -(-len(tokens) // bs)
    cache = new_cache(model, blocks, bs, mx.float32)
    meta = build_metadata([SequenceSlice(list(range(blocks)), 0, len(tokens))], bs)
    return model(mx.array(tokens), cache, meta)[-1]


def greedy_reference(model, prompt: list[int], max_tokens: int, eos: int | None = 0) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = int(mx.argmax(full_forward_logits(model, tokens)).item())
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out
