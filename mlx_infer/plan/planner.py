"""The memory plan: weights, KV cache and scratch against this machine's budget, and the decode bound.

KV bytes follow the engine's pools (``kv/memory.py``, ``interface/kv.py``'s ``LayerKV``): every
full-attention layer holds K and V of ``n_kv_heads x head_dim`` for every token of the context;
sequences take whole blocks of 16 tokens. Where a model mixes them with sliding-window layers (Gemma 3
and 4, gpt-oss), those have a pool of their own sized by the windows of the running sequences, not by
the context (``kv/window.py``, :func:`window_pool_blocks`). ``int8`` adds one float32 scale per
(token, KV head) to K and to V.

Scratch is what a step allocates beyond weights and pool, as measured on the CPU engine with SmolLM2
(``mx.get_peak_memory`` during chunked prefill, tests/test_plan.py), in two shapes:

- Blocks the native CPU kernels run as one op a step (``models/native_block.py``: Llama-style blocks with
  quantized layers the kernels cover): one block's buffers at a time (about ``3 x hidden + 2 x (q + k) +
  3 x intermediate`` values a token, taken from MLX's allocator so that they count; the products'
  quantized copies of x, under 2 MB a 512-token SmolLM2 step, stay on the C++ heap), the
  stack's input and output and the embedding of the step in flight and of the next one (about ``4 x
  hidden`` each), and the logits of every sequence. The pools are written in place: no copies.
- Op by op (Metal, and the CPU for other models; measured on the CPU before the native blocks): the
  activations of the step in flight and of the next one being built (about ``8 x hidden + 2 x (q + k +
  v) + 3 x intermediate`` values a token each), the logits of every sequence, and copies of K/V pools:
  while a partial-prefill step is in flight it still references the pools, so the next step's writes
  cannot reuse their buffers in place, and about four layers' K and V pools exist twice.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from mlx_infer.errors import InvalidRequest
from mlx_infer.interface.kv import KVSpec, window_of
from mlx_infer.kv.memory import DEFAULT_FRACTION, MAX_DEFAULT_BYTES
from mlx_infer.models.native_block import stacked
from mlx_infer.plan.bandwidth import memory_bandwidth
from mlx_infer.plan.weights import FLOAT_BYTES, Metadata, convert_to_bits, held, read_metadata

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
BUDGET_ENV = "MLX_INFER_MEMORY_BUDGET"  # overrides the device's memory, e.g. "8GiB" (tests, what-ifs)
BLOCK_SIZE = 16
STEP_TOKENS = 512  # SchedulerConfig's max_num_batched_tokens: the largest step's token count
IN_FLIGHT_STEPS = 2
POOL_COPY_LAYERS = 4
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@dataclass
class Plan:
    model: str
    backend: str  # "cpu" or "metal"
    weights: str  # how they are held, in the weight policy's words
    weights_bytes: int
    kv_cache_dtype: str  # resolved: "auto" never appears here
    kv_bytes_per_token: int  # of the full-attention layers: what grows with the context
    context: int
    max_num_seqs: int
    kv_bytes: int
    scratch_bytes: int
    total_bytes: int
    budget_bytes: int
    budget_source: str
    fits: bool
    weights_fit: bool
    model_max_context: int
    max_context_that_fits: int  # per sequence, at max_num_seqs sequences (0: not even one token)
    max_num_seqs_that_fit: int  # at the planned context
    default_kv_pool_bytes: int  # what serve/generate's KV pool may take without --kv-memory
    decode_tok_s_bound: float  # one sequence at the planned context
    decode_tok_s_bound_batch: float  # all max_num_seqs together at the planned context
    bandwidth_bytes_s: float
    bandwidth_source: str
    # Recurrent state of max_num_seqs sequences (hybrid models' linear-attention layers; in total_bytes).
    state_bytes: int = 0
    # The sliding-window layers' own pool (in kv_bytes): fixed by the window and max_num_seqs.
    window_kv_bytes: int = 0
    # --context past the model's: what was asked (the plan is at model_max_context, as the engine runs).
    context_requested: int | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V bytes of one token over all layers (the agreed convention of --kv-cache-dtype)."""
    if dtype == "int8":
        return 2 * n_layers * n_kv_heads * (head_dim + 4)  # int8 values plus a float32 scale per head
    return 2 * n_layers * n_kv_heads * head_dim * FLOAT_BYTES[dtype]


def layout_bytes_per_token(layout: list[KVSpec], dtype: str, windowed: bool | None = None) -> int:
    """K and V bytes of one token over the layers of ``layout`` that own pools; a layer whose values lie
    in its key rows (MLA's latent) has no V pool. ``windowed``: only the layers of the sliding-window
    pool (True) or of the main one (False), as :func:`window_of` splits them."""
    window = window_of(layout)
    return sum(
        kv_bytes_per_token(1, s.n_kv_heads, s.head_dim, dtype) // (2 if s.values_in_keys else 1)
        for s in layout
        if s.owns_pool and (windowed is None or (window is not None and s.window is not None) == windowed)
    )


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """Blocks the sliding-window layers' pool needs (``kv/window.py``): each running sequence holds the
    blocks its window spans plus the partial ones at either end, and a step's new tokens (prefill
    chunks, verified proposals) need blocks beyond that."""
    per_sequence = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_sequence + -(-step_tokens // block_size)


def layout_state_bytes(layout: list) -> int:
    """Recurrent-state bytes of one sequence over the layers of ``layout`` that keep a state
    (``interface/state.py``'s ``StateSpec``: a fixed size per sequence, whatever its length)."""
    return sum(s.bytes_per_slot() for s in layout if hasattr(s, "bytes_per_slot"))


def check_kv_dtype(choice: str) -> None:
    if choice not in KV_CACHE_DTYPES:
        raise InvalidRequest(
            f"unknown --kv-cache-dtype {choice!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )


def resolve_kv_dtype(choice: str, backend: str, compute_dtype: str) -> str:
    """``auto``: float16 on the CPU backend, the model's compute dtype on Metal."""
    check_kv_dtype(choice)
    if choice != "auto":
        return choice
    return "float16" if backend == "cpu" else compute_dtype


def memory_budget() -> tuple[int, str]:
    """(bytes, where from): ``$MLX_INFER_MEMORY_BUDGET``, else Metal's recommended working set or RAM."""
    value = os.environ.get(BUDGET_ENV)
    if value:
        return parse_bytes(value, BUDGET_ENV), f"${BUDGET_ENV}"
    import mlx.core as mx

    from mlx_infer.kv.memory import device_memory_bytes

    where = "Metal recommended working set" if mx.metal.is_available() else "RAM"
    return device_memory_bytes(), where


def parse_bytes(text: str, what: str) -> int:
    """``"8GiB"``, ``"500 MB"``, ``"1e9"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise InvalidRequest(f"{what}: {text!r} is not a size (e.g. 8GiB, 500MB, 1000000)")
    return int(float(match.group(1)) * _UNITS[unit])


def backend_name() -> str:
    from mlx_infer.loading.policy import cpu_backend

    return "cpu" if cpu_backend() else "metal"


def make_plan(
    spec: str,
    context: int | None = None,
    max_num_seqs: int = 1,
    kv_cache_dtype: str = "auto",
    q_bits: int | None = None,
    keep_quantized: bool | None = None,
    step_tokens: int = STEP_TOKENS,
    backend: str | None = None,
) -> Plan:
    """The plan for serving ``spec``: ``max_num_seqs`` sequences of ``context`` tokens (default: the
    model's context length), from metadata only. ``backend`` defaults to the one this process runs."""
    for flag, value in (("--context", context), ("--max-num-seqs", max_num_seqs), ("--q-bits", q_bits)):
        if value is not None and value <= 0:
            raise InvalidRequest(f"{flag} must be positive, not {value}")
    backend = backend or backend_name()
    meta = read_metadata(spec, backend, keep_quantized)
    tensors = convert_to_bits(meta.tensors, q_bits) if q_bits else meta.tensors
    tensors, how, kernels = held(tensors, backend, keep_quantized, getattr(meta.model, "row_tables", ()))
    weights_bytes = sum(t.nbytes for t in tensors)
    # With the CPU kernels embedding lookups come out float32 whatever the scales (policy.py).
    compute_dtype = "float32" if kernels else _compute_dtype(tensors)
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, backend, compute_dtype)
    n_layers = len(meta.model.layers)
    layout = meta.model.kv_layout()
    per_token = layout_bytes_per_token(layout, kv_dtype, windowed=False)
    model_max = _max_context(meta)
    # The engine caps a longer context at the model's own (loading._max_context): plan what it runs.
    requested = context if context is not None and context > model_max else None
    context = min(context or model_max, model_max)
    seq_tokens = _blocks(context) * BLOCK_SIZE
    window = window_of(layout)
    window_kv_bytes = window_read = 0
    if window is not None:
        window_blocks = min(
            window_pool_blocks(window, BLOCK_SIZE, max_num_seqs, step_tokens), max_num_seqs * _blocks(context)
        )
        window_per_token = layout_bytes_per_token(layout, kv_dtype, windowed=True)
        window_kv_bytes = window_blocks * BLOCK_SIZE * window_per_token
        window_read = min(window, seq_tokens) * window_per_token  # what one decode step reads of them
    kv_bytes = max_num_seqs * seq_tokens * per_token + window_kv_bytes
    # The engine keeps one state slot per sequence that may run and as many states saved for prefix
    # caching (engine.hybrid_state).
    state_bytes = 2 * max_num_seqs * layout_state_bytes(layout)
    native = kernels and stacked(meta.model)
    fixed_scratch = _fixed_scratch(meta.model, compute_dtype, max_num_seqs, step_tokens, native)
    # Of the pool, see the module's docstring.
    pool_copies = 0.0 if native else min(POOL_COPY_LAYERS, n_layers) / n_layers
    scratch = fixed_scratch + int(kv_bytes * pool_copies)
    total = weights_bytes + kv_bytes + state_bytes + scratch
    budget, budget_source = memory_budget()
    # The most pool tokens the budget leaves once weights, states, the sliding-window pool and the fixed
    # scratch are counted.
    free = budget - weights_bytes - fixed_scratch - state_bytes - window_kv_bytes * (1 + pool_copies)
    if free <= 0:
        pool_tokens = 0
    elif per_token == 0:  # recurrent layers only: nothing grows with the context, states are counted
        pool_tokens = max_num_seqs * model_max
    else:
        pool_tokens = int(free / (per_token * (1 + pool_copies)))
    # The most sequences of N tokens: each brings its K/V (and their copies), its logits and its states,
    # whatever S was asked for.
    shared_scratch = fixed_scratch - _logits_bytes(meta.model, max_num_seqs)
    kv_per_sequence = seq_tokens * per_token * (1 + pool_copies)
    per_sequence = kv_per_sequence + _logits_bytes(meta.model, 1) + state_bytes // max_num_seqs
    room = budget - weights_bytes - shared_scratch - window_kv_bytes * (1 + pool_copies)
    seqs_that_fit = int(max(room, 0) // per_sequence)
    bandwidth, bandwidth_source = memory_bandwidth()
    # kv/memory.kv_budget_bytes without --kv-memory, the weights being what is loaded by then.
    default_pool = int(min(max(budget - weights_bytes, 0) * DEFAULT_FRACTION, MAX_DEFAULT_BYTES))
    read = sum(t.nbytes * t.read_fraction for t in tensors)
    context_read = seq_tokens * per_token + window_read
    return Plan(
        model=spec,
        backend=backend,
        weights=f"{how}, {_dtypes_text(tensors)}" if how else _dtypes_text(tensors),
        weights_bytes=weights_bytes,
        kv_cache_dtype=kv_dtype,
        kv_bytes_per_token=per_token,
        context=context,
        max_num_seqs=max_num_seqs,
        kv_bytes=kv_bytes,
        scratch_bytes=scratch,
        total_bytes=total,
        budget_bytes=budget,
        budget_source=budget_source,
        fits=total <= budget,
        weights_fit=weights_bytes <= budget,
        model_max_context=model_max,
        context_requested=requested,
        max_context_that_fits=min(model_max, pool_tokens // max_num_seqs // BLOCK_SIZE * BLOCK_SIZE),
        max_num_seqs_that_fit=seqs_that_fit,
        default_kv_pool_bytes=default_pool,
        decode_tok_s_bound=bandwidth / (read + context_read),
        decode_tok_s_bound_batch=max_num_seqs * bandwidth / (read + max_num_seqs * context_read),
        bandwidth_bytes_s=bandwidth,
        bandwidth_source=bandwidth_source,
        state_bytes=state_bytes,
        window_kv_bytes=window_kv_bytes,
    )


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _max_context(meta: Metadata) -> int:
    # loading._max_context: the config's, else the model's args, else 4096.
    text = meta.config.get("text_config", meta.config)
    value = text.get("max_position_embeddings") or getattr(meta.model.args, "max_position_embeddings", None)
    return int(value or 4096)


def _compute_dtype(tensors: list) -> str:
    """What the model computes in (runner.activation_dtype): its embedding's dtype, or its scales'."""
    for t in tensors:
        if t.name in ("model.embed_tokens.weight", "token_embd.weight"):
            return t.dtype
    return tensors[0].dtype


def _fixed_scratch(model: Any, dtype: str, max_num_seqs: int, step_tokens: int, native: bool) -> int:
    """Activations of the steps in flight and the logits of every sequence (the module's docstring);
    ``native``: the blocks run as the native CPU kernels' one op a step."""
    args = model.args
    hidden, heads = args.hidden_size, args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    intermediate = getattr(args, "intermediate_size", None) or 4 * hidden
    if getattr(args, "num_experts_per_tok", None):
        intermediate = getattr(args, "moe_intermediate_size", intermediate) * args.num_experts_per_tok
    if native:
        block = 3 * hidden + 2 * (heads + kv_heads) * head_dim + 3 * intermediate
        activations = step_tokens * (block + IN_FLIGHT_STEPS * 4 * hidden) * FLOAT_BYTES[dtype]
    else:
        per_token = 8 * hidden + 2 * (heads + 2 * kv_heads) * head_dim + 3 * intermediate
        activations = IN_FLIGHT_STEPS * step_tokens * per_token * FLOAT_BYTES[dtype]
    return activations + _logits_bytes(model, max_num_seqs)


def _logits_bytes(model: Any, num_seqs: int) -> int:
    """The float32 logits (for sampling) of ``num_seqs`` sequences in the steps in flight."""
    return IN_FLIGHT_STEPS * num_seqs * model.args.vocab_size * 4


def _dtypes_text(tensors: list) -> str:
    kinds = sorted({t.dtype for t in tensors if not t.gguf_bytes and t.mode != "mxfp4"})
    quantized = sorted({_quant_label(t) for t in tensors if t.bits})
    raw = "GGUF blocks + " if any(t.gguf_bytes for t in tensors) else ""
    return raw + (" + ".join(quantized) + " + " if quantized else "") + "/".join(kinds)


def _quant_label(t: Any) -> str:
    return f"{t.bits}-bit g{t.group_size}" if t.mode == "affine" else t.mode


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
