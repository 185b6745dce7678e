"""A rewrite of a loaded float model for the CPU backend: fewer, faster ops per decode step.

On MLX's CPU backend a decode step is dominated by matrix-vector products through BLAS and by the
fixed cost of each op (docs: /work/shared/FACTS.md). :func:`fuse_projections` changes how a loaded
model computes, never what its parameters are:

- every float ``nn.Linear`` (and a tied embedding) stores its weight transposed, ``[in, out]`` in
  memory behind the same ``[out, in]`` array: ``x @ weight.T`` then reaches BLAS untransposed, which
  for one row is MKL's fast matrix-vector kernel (about twice as fast as the transposed one here);
- q/k/v and gate/up projections that read the same input share one fused weight: one matmul instead
  of three (two), their own weights becoming views into it (float layers, and quantized layers that
  the native CPU kernels compute: packed rows, scales and biases concatenated);
- RMSNorm runs as one op of the native CPU kernels (``cpu_kernels``), or a compiled (fused) kernel
  without them; the SwiGLU/GELU gating as a compiled kernel (RoPE has its own CPU path in
  ``rope_cpu.py``).

Parameter names, shapes and values stay the Hugging Face ones (``model.parameters()`` and saving are
unchanged, memory is not duplicated). A module whose weight is replaced afterwards (``load_weights``,
``update``) stops using the fused weight and computes from its own again.
"""

from __future__ import annotations

import threading
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.interface import watched
from mlx_infer.metal_kernels import dispatch
from mlx_infer.metal_kernels.layers import KernelQuantizedLinear
from mlx_infer.models import gemma3, llama


def fuse_projections(model: nn.Module) -> str:
    """Rewrite ``model`` in place (see the module docstring); returns a one-line summary.

    Idempotent: a model already rewritten is left as it is.
    """
    if getattr(model, "_fused_summary", None):
        return model._fused_summary
    fused_attention = fused_mlp = norms = 0
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if not isinstance(child, nn.Module):
                continue
            if type(child) in _ACTIVATIONS and _fusable(child, ("gate_proj", "up_proj")):
                replacements.append((module, name, FusedMLP(child, _ACTIVATIONS[type(child)])))
                fused_mlp += 1
            elif type(child) is nn.RMSNorm:
                replacements.append((module, name, CompiledRMSNorm(child)))
                norms += 1
            elif type(child) is gemma3.RMSNorm:
                replacements.append((module, name, CompiledGemmaRMSNorm(child)))
                norms += 1
        if _fusable(module, ("q_proj", "k_proj", "v_proj")):
            _fuse_group(module, ("q_proj", "k_proj", "v_proj"))
            fused_attention += 1
        # Other input projections a module declares as reading one input (e.g. a DeltaNet's q|k|v, z, b, a).
        for names in getattr(type(module), "fused_projections", ()):
            if _fusable(module, names):
                _fuse_group(module, names)
    for parent, name, new in replacements:
        setattr(parent, name, new)
    transposed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and _is_float(module.weight):
            module.weight = _transposed_storage(module.weight)
            transposed += 1
    inner = model.get("model")
    embed = inner.get("embed_tokens") if isinstance(inner, nn.Module) else None
    if getattr(model.args, "tie_word_embeddings", False) and type(embed) is nn.Embedding:
        # The tied head reads the table as x @ weight.T; lookups read a few strided rows, cheap.
        embed.weight = _transposed_storage(embed.weight)
        transposed += 1
    mx.eval(model.parameters())
    model._fused_summary = (
        f"fused q/k/v in {fused_attention} and gate/up in {fused_mlp} layers, {norms} norms compiled, "
        f"{transposed} other weights stored transposed"
    )
    return model._fused_summary


def _is_float(a: mx.array) -> bool:
    return mx.issubdtype(a.dtype, mx.floating)


def _fusable(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``module`` has children ``names`` over one input that can share one product: all float
    ``nn.Linear`` in one dtype, or all kernel-dispatch quantized layers with one bit width and group
    size; all with or all without bias."""
    linears = [module.get(n) for n in names]
    if not all(type(lin) in (nn.Linear, KernelQuantizedLinear) for lin in linears):
        return False
    if len({type(lin) for lin in linears}) != 1 or len({"bias" in lin for lin in linears}) != 1:
        return False
    weights = [lin.weight for lin in linears]
    if len({w.shape[1] for w in weights}) != 1:
        return False
    if type(linears[0]) is KernelQuantizedLinear:
        return len({(lin.bits, lin.group_size) for lin in linears}) == 1
    return all(_is_float(w) and w.dtype == weights[0].dtype for w in weights)


def _transposed_storage(w: mx.array) -> mx.array:
    """The same ``[out, in]`` values, laid out as ``[in, out]`` in memory."""
    t = mx.contiguous(w.T)
    mx.eval(t)
    return t.T


class _Fused:
    """The product of layers that read the same input, computed once (``_product``) and split.

    The first member called with an input computes the product for all; the others take their slice
    of it. The pending product is dropped once every member has taken its slice (or as soon as any
    member sees a different input), so nothing outlives the layer call.
    """

    def __init__(self, sizes: list[int]):
        self.offsets = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        self.bounds = list(zip([0] + self.offsets, self.offsets + [sum(sizes)]))
        self.count = len(sizes)
        self._pending = threading.local()  # engines stepping one model on two threads stay apart

    def _product(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def output(self, x: mx.array, index: int) -> mx.array:
        p = self._pending
        if getattr(p, "x", None) is not x or index in p.taken:
            p.x, p.parts, p.taken = x, mx.split(self._product(x), self.offsets, axis=-1), set()
        p.taken.add(index)
        out = p.parts[index]
        if len(p.taken) == self.count:
            p.x = p.parts = None
        return out


class _FusedWeight(_Fused):
    """``[in, sum(out)]`` float weight (and bias) of linear layers that read the same input."""

    def __init__(self, weights: list[mx.array], biases: list[mx.array] | None):
        super().__init__([w.shape[0] for w in weights])
        self.weight_t = mx.concatenate([w.T for w in weights], axis=1)
        self.bias = None if biases is None else mx.concatenate(biases)
        mx.eval(self.weight_t, self.bias)

    def views(self, index: int) -> dict[str, mx.array]:
        """Member ``index``'s own ``[out, in]`` weight (and bias), as views into the fused ones."""
        start, stop = self.bounds[index]
        views = {"weight": self.weight_t[:, start:stop].T}
        if self.bias is not None:
            views["bias"] = self.bias[start:stop]
        return views

    def _product(self, x: mx.array) -> mx.array:
        return x @ self.weight_t if self.bias is None else mx.addmm(self.bias, x, self.weight_t)


class _FusedQuantized(_Fused):
    """Row-concatenated packed weights, scales, biases (and bias) of kernel-dispatch quantized layers."""

    def __init__(self, layers: list[KernelQuantizedLinear]):
        super().__init__([lin.weight.shape[0] for lin in layers])
        self.group_size, self.bits = layers[0].group_size, layers[0].bits
        self.params = {
            name: mx.concatenate([lin[name] for lin in layers])
            for name in ("weight", "scales", "biases", "bias")
            if name in layers[0]
        }
        mx.eval(self.params)

    def views(self, index: int) -> dict[str, mx.array]:
        start, stop = self.bounds[index]
        return {name: a[start:stop] for name, a in self.params.items()}

    def _product(self, x: mx.array) -> mx.array:
        p = self.params
        return dispatch.quantized_matmul(
            x, p["weight"], p["scales"], p["biases"], self.group_size, self.bits, p.get("bias")
        )


class _Member:
    """What a member of a fused group adds to its layer: its parameters are views into the fused ones,
    and it takes its slice of the shared product while they still are."""

    def _join(self, fused: _Fused, index: int) -> None:
        self._views = fused.views(index)
        for name, view in self._views.items():
            self[name] = view
        self._fused = fused
        self._index = index

    def _shared_output(self, x: mx.array) -> mx.array | None:
        """This member's slice of the shared product, or None once a parameter was replaced since
        fusing (``load_weights``, ``update``): the fused weight is stale, the layer computes alone."""
        if all(self.get(name) is view for name, view in self._views.items()):
            return self._fused.output(x, self._index)
        return None


class FusedLinear(_Member, nn.Module):
    """One member of a :class:`_FusedWeight`: an ``nn.Linear`` whose weight is a view into the fused one."""

    def __init__(self, fused: _FusedWeight, index: int):
        super().__init__()
        self._join(fused, index)

    def __call__(self, x: mx.array) -> mx.array:
        shared = self._shared_output(x)
        if shared is not None:
            return shared
        bias = self.get("bias")
        return x @ self["weight"].T if bias is None else mx.addmm(bias, x, self["weight"].T)


class FusedQuantizedLinear(_Member, KernelQuantizedLinear):
    """One member of a :class:`_FusedQuantized`: its packed rows, scales and biases are views into the
    fused ones."""

    def __init__(self, fused: _FusedQuantized, layer: KernelQuantizedLinear, index: int):
        super().__init__(layer)
        self._join(fused, index)

    def __call__(self, x: mx.array) -> mx.array:
        shared = self._shared_output(x)
        return super().__call__(x) if shared is None else shared


def _fuse_group(module: nn.Module, names: tuple[str, ...]) -> None:
    linears = [module[n] for n in names]
    if type(linears[0]) is KernelQuantizedLinear:
        fused_q = _FusedQuantized(linears)
        for i, name in enumerate(names):
            setattr(module, name, FusedQuantizedLinear(fused_q, linears[i], i))
        return
    biases = [lin.bias for lin in linears] if "bias" in linears[0] else None
    fused = _FusedWeight([lin.weight for lin in linears], biases)
    for i, name in enumerate(names):
        setattr(module, name, FusedLinear(fused, i))


@partial(mx.compile, shapeless=True)
def silu_gate(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _gelu_gate(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


# MLP classes computing down(act(gate(x)) * up(x)), and their compiled act(gate) * up.
_ACTIVATIONS = {llama.MLP: silu_gate, gemma3.MLP: _gelu_gate}


class FusedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate/up fused and the gating compiled."""

    def __init__(self, mlp: nn.Module, gate_fn):
        super().__init__()
        _fuse_group(mlp, ("gate_proj", "up_proj"))
        for name, child in mlp.children().items():  # in the original order: parameters() order
            setattr(self, name, child)
        self._gate_fn = gate_fn

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._gate_fn(self.gate_proj(x), self.up_proj(x)))


class CompiledRMSNorm(watched.Watched, nn.RMSNorm):
    def __init__(self, norm: nn.RMSNorm):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight

    def __call__(self, x: mx.array) -> mx.array:
        native = cpu_kernels.rms_norm(x, self["weight"], self.eps)
        return _compiled_rms(self.eps)(x, self["weight"]) if native is None else native


class CompiledGemmaRMSNorm(gemma3.RMSNorm):
    def __init__(self, norm: gemma3.RMSNorm):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight

    def __call__(self, x: mx.array) -> mx.array:
        native = cpu_kernels.rms_norm(x, self["weight"], self.eps, offset=True)
        return _compiled_rms(self.eps, offset=True)(x, self["weight"]) if native is None else native


_RMS_CACHE: dict[tuple[float, bool], object] = {}


def _compiled_rms(eps: float, offset: bool = False):
    """A shapeless compiled RMSNorm per ``eps`` (a constant of the graph); ``offset``: weight is 1 + w."""
    key = (eps, offset)
    fn = _RMS_CACHE.get(key)
    if fn is None:
        if offset:
            fn = mx.compile(lambda x, w: mx.fast.rms_norm(x, 1.0 + w, eps), shapeless=True)
        else:
            fn = mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps), shapeless=True)
        _RMS_CACHE[key] = fn
    return fn
