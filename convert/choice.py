"""Each layer's output form, judged against how the source stores it, and the warnings for lossy ones.

A layer the source already stores on a grid the requested parameters hold exactly (``QuantParams.holds``:
GGUF Q4_0/Q4_1 for affine 4-bit g32, Q8_0 for 8-bit g32, an mlx-community folder's own parameters) is
copied, or widened without loss. A layer the source keeps at more bits than requested (the Q8_0 token
embedding / output of a Q4 GGUF) keeps them unless ``--pure``, as llama-quantize keeps ``output.weight``
at higher precision. Only the rest is quantized from its values; for a layer the source had already
quantized that rounds a second time, and a warning says so, and why, before any work starts.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from .quant import MODES, Plan, QuantParams
from .weights import Layer

# What happens to a layer: copied bit for bit, widened exactly (more bits, or groups split), kept as the
# source stores it, re-quantized (lossy), quantized from floating point, or written in floating point.
KINDS = ("copied", "widened", "kept", "requantized", "quantized", "float")


@dataclass
class Choices:
    targets: dict[str, QuantParams | None] = field(default_factory=dict)  # None: floating point
    kinds: dict[str, str] = field(default_factory=dict)
    unquantized: list[dict[str, Any]] = field(default_factory=list)  # float layers the group cannot split
    kept: list[dict[str, Any]] = field(default_factory=list)  # quantized layers kept as the source has them

    def counts(self) -> dict[str, int]:
        counts = Counter(self.kinds.values())
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    def paths(self, *kinds: str) -> list[str]:
        return [path for path, kind in self.kinds.items() if kind in kinds]


def source_group_size(layers: dict[str, Layer], mode: str) -> int | None:
    """The group size most of the source's quantized layers of ``mode`` use (the default when the user
    gives none), or None when the source has none the mode allows."""
    allowed = MODES[mode][1]
    counts = Counter(layer.source.group_size for layer in layers.values()
                     if layer.source is not None and layer.source.mode == mode
                     and layer.source.group_size in allowed)
    return counts.most_common(1)[0][0] if counts else None


def choose(layers: dict[str, Layer], plan: Plan | None, dequantize: bool, pure: bool) -> Choices:
    choices = Choices()
    for path, layer in layers.items():
        if plan is None:  # no --q-* and no recipe: every layer as the source has it, or in floating point
            target = None if dequantize else layer.source
            kind = "float" if target is None else "copied"
        else:
            target, kind = _choose_one(layer, plan.params_for(path), pure, choices)
        choices.targets[path], choices.kinds[path] = target, kind
    return choices


def _choose_one(
    layer: Layer, want: QuantParams, pure: bool, choices: Choices
) -> tuple[QuantParams | None, str]:
    src = layer.source
    if src is not None and want.holds(src):
        return want, "copied" if want == src else "widened"
    if src is not None and src.bits > want.bits and not pure:
        choices.kept.append({"layer": layer.path, "as": str(src), "reason": f"more bits than {want.bits}"})
        return src, "kept"
    if layer.in_features % want.group_size:
        if src is not None:  # exact as it is, where re-quantizing would need a float copy instead
            reason = f"group size {want.group_size} does not divide its {layer.in_features} inputs"
            choices.kept.append({"layer": layer.path, "as": str(src), "reason": reason})
            return src, "kept"
        choices.unquantized.append(
            {"layer": layer.path, "input_size": layer.in_features, "group_size": want.group_size})
        return None, "float"
    return want, "requantized" if src is not None else "quantized"


def warnings(layers: dict[str, Layer], choices: Choices, explicit_group: bool) -> list[str]:
    """One line per (source form, output form) pair of re-quantized layers, with the reason and what
    to change to avoid it."""
    lossy = _by_forms(layers, choices, "requantized")
    return [f"re-quantizing {_count(paths)} the source stores as {src} to {target} rounds them again "
            f"(lossy): {_reason(src, target, explicit_group)}" for (src, target), paths in lossy.items()]


def notes(layers: dict[str, Layer], choices: Choices) -> list[str]:
    """What is exact but not what was asked for: layers widened, and layers kept at more bits."""
    lines = [f"widening {_count(paths)} from {src} to {target} exactly: larger, but no more accurate "
             "than the source" for (src, target), paths in _by_forms(layers, choices, "widened").items()]
    higher = [k for k in choices.kept if k["reason"].startswith("more bits")]
    if higher:
        forms = ", ".join(sorted({k["as"] for k in higher}))
        names = ", ".join(k["layer"] for k in higher[:3]) + (" ..." if len(higher) > 3 else "")
        lines.append(f"keeping {_count(higher)} ({names}) as stored in the source ({forms}): "
                     "more bits than requested; --pure re-quantizes them too")
    return lines


def _by_forms(
    layers: dict[str, Layer], choices: Choices, kind: str
) -> dict[tuple[QuantParams, QuantParams], list[str]]:
    forms: dict[tuple[QuantParams, QuantParams], list[str]] = defaultdict(list)
    for path in choices.paths(kind):
        src, target = layers[path].source, choices.targets[path]
        assert src is not None and target is not None  # both quantized for these kinds
        forms[src, target].append(path)
    return forms


def _reason(src: QuantParams, target: QuantParams, explicit_group: bool) -> str:
    if target.bits < src.bits:
        return f"--pure takes them below the {src.bits} bits the source keeps"
    if target.mode != src.mode:
        return f"{target.mode} cannot represent {src.mode} values exactly"
    if src.group_size % target.group_size:
        hint = ("; without --q-group-size the output keeps the source's groups and copies them exactly"
                if explicit_group and target.mode == "affine" and target.bits == src.bits else "")
        return f"groups of {target.group_size} do not split the source's groups of {src.group_size}{hint}"
    return f"{target} cannot hold {src} values exactly"


def _count(items: list[Any]) -> str:
    return f"{len(items)} layer" + ("" if len(items) == 1 else "s")
