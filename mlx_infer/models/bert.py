"""BERT encoders (all-MiniLM, BGE, E5, GTE and other sentence-transformers models of that family).

Unlike the decoders of this package, an encoder attends in both directions over a padded batch and keeps
no KV cache: ``Model(input_ids [B, L], attention_mask [B, L])`` returns the last hidden states
``[B, L, D]``, which ``mlx_infer.embedding`` pools into one vector per input. Parameter names are Hugging
Face's (``embeddings.word_embeddings``, ``encoder.layer.N.attention.self.query``, ...), so a checkpoint
loads as transformers' ``BertModel`` saves it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.models.base import BaseModelArgs

# transformers' ACT2FN names -> MLX; "gelu" is the exact (erf) GELU, as in transformers.
ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_embedding_type: str = "absolute"

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported")
        if self.position_embedding_type != "absolute":
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not supported")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array) -> mx.array:
        positions = mx.arange(input_ids.shape[1])
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(h + self.token_type_embeddings(token_type_ids))


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, _ = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            scale=self.head_dim**-0.5,
            mask=mask,
        )
        return out.transpose(0, 2, 1, 3).reshape(b, n, -1)


class SelfOutput(nn.Module):
    """The projection after attention (or the MLP), dropout-free, then the residual LayerNorm."""

    def __init__(self, in_dim: int, args: ModelArgs):
        super().__init__()
        self.dense = nn.Linear(in_dim, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, h: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(h) + residual)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self = SelfAttention(args)  # HF's name: encoder.layer.N.attention.self.query
        self.output = SelfOutput(args.hidden_size, args)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Intermediate(args)
        self.output = SelfOutput(args.intermediate_size, args)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layer = [Layer(args) for _ in range(args.num_hidden_layers)]


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)

    def __call__(self, input_ids: mx.array, attention_mask: mx.array) -> mx.array:
        """Last hidden states ``[B, L, D]`` of a right-padded batch; ``attention_mask`` is 1 on real tokens.

        Padding keys are masked out, so a row's real tokens get the values they would get alone.
        """
        h = self.embeddings(input_ids, mx.zeros_like(input_ids))
        # Additive mask over keys, [B, 1, 1, L]: every query row keeps at least its own sequence's keys.
        mask = mx.where(attention_mask.astype(mx.bool_), 0.0, -mx.inf)[:, None, None, :].astype(h.dtype)
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h

    @property
    def max_position_embeddings(self) -> int:
        return self.args.max_position_embeddings

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF names -> ours: drop a task model's ``bert.`` prefix, its heads (pooler, MLM/NSP ``cls.``),
        the ``position_ids`` buffer, and rename old checkpoints' LayerNorm ``gamma``/``beta``."""
        out = {}
        for name, value in weights.items():
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue
            if ".LayerNorm." in name:
                name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
            out[name] = value
        return out
