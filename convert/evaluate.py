"""What quantization cost: next-token distributions of the source and the output model compared.

Both models run in float32 (quantized layers dequantized exactly), so the numbers measure the weights'
rounding and nothing else. Each window of the evaluation text goes through one uncached forward (the
engine-free path: ``build_metadata`` + fresh pools) that returns the logits of every position.
Metrics, per predicted position: KL(source || output) (as llama.cpp's ``--kl-divergence``), whether the
argmax tokens agree ("flips" are the disagreements), and each model's negative log-likelihood of the
actual next token (perplexity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer.errors import InvalidRequest
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache

DEFAULT_EVAL_FILE = Path(__file__).with_name("eval_text.txt")
WINDOW = 512  # tokens per forward: long enough for context, short enough for CPU memory and time
BLOCK_SIZE = 16


@dataclass
class Quality:
    tokens: int  # predicted positions
    windows: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    ppl_source: float
    ppl_output: float
    text: str = ""  # what was evaluated: the --eval-file, or the shipped prose

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_windows(tokenizer: Any, path: Path, max_tokens: int) -> list[list[int]]:
    """The text's first ``max_tokens`` tokens cut into windows, each led by the model's BOS if it
    adds one (``encode("")`` is exactly what it adds in front of a text)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read evaluation text {path}: {e}") from None
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    if len(ids) < 2:
        raise InvalidRequest(f"evaluation text {path} has fewer than 2 tokens")
    prefix = tokenizer.encode("", add_special_tokens=True)
    step = WINDOW - len(prefix)
    windows = [prefix + ids[i : i + step] for i in range(0, len(ids), step)]
    return [w for w in windows if len(w) > 1]


def all_logprobs(model: nn.Module, tokens: list[int]) -> mx.array:
    """log-softmax over the vocabulary at every position of one uncached forward, float32 [T, V]."""
    blocks = -(-len(tokens) // BLOCK_SIZE)
    cache = new_cache(model, blocks, BLOCK_SIZE, mx.float32)
    whole = SequenceSlice(list(range(blocks)), 0, len(tokens), want_all_logits=True)
    meta = build_metadata([whole], BLOCK_SIZE)
    logits = model(mx.array(tokens), cache, meta).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(
    source: nn.Module, output: nn.Module, windows: list[list[int]], on_window: Callable[[], None]
) -> Quality:
    kl, agree, nll_s, nll_o = [], [], [], []
    for tokens in windows:
        targets = mx.array(tokens[1:])[:, None]
        lp_s = all_logprobs(source, tokens)[:-1]
        lp_o = all_logprobs(output, tokens)[:-1]
        # Clamped at 0: identical distributions can round to -1e-9, and KL is never negative.
        row_kl = mx.maximum(mx.sum(mx.exp(lp_s) * (lp_s - lp_o), axis=-1), 0.0)
        same = mx.argmax(lp_s, axis=-1) == mx.argmax(lp_o, axis=-1)
        row_s = -mx.take_along_axis(lp_s, targets, axis=-1)[:, 0]
        row_o = -mx.take_along_axis(lp_o, targets, axis=-1)[:, 0]
        mx.eval(row_kl, same, row_s, row_o)
        for acc, row in ((kl, row_kl), (agree, same), (nll_s, row_s), (nll_o, row_o)):
            acc.append(np.array(row))
        on_window()
    kl_all = np.concatenate(kl).astype(np.float64)
    return Quality(
        tokens=int(kl_all.size),
        windows=len(windows),
        kl_mean=float(kl_all.mean()),
        kl_p99=float(np.percentile(kl_all, 99)),
        kl_max=float(kl_all.max()),
        top1_agreement=float(np.concatenate(agree).mean()),
        ppl_source=float(np.exp(np.concatenate(nll_s).astype(np.float64).mean())),
        ppl_output=float(np.exp(np.concatenate(nll_o).astype(np.float64).mean())),
    )
