"""What each weight becomes: quantization parameters, their validation, mixed-precision recipes.

The modes, bits and group sizes are those ``mx.quantize`` of MLX 0.32 accepts: affine takes 2..8 bits
(not 7) with groups of 32, 64 or 128; the microscaling formats fix both (mxfp4: 4 bits/32, nvfp4:
4 bits/16, mxfp8: 8 bits/32). Checked here so bad options fail before anything is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_infer.errors import InvalidRequest

# mode -> (allowed bits, allowed group sizes, default bits, default group size)
MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]] = {
    "affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128), 4, 64),
    "mxfp4": ((4,), (32,), 4, 32),
    "nvfp4": ((4,), (16,), 4, 16),
    "mxfp8": ((8,), (32,), 8, 32),
}
# Mixed-precision recipes (mlx-lm's names): low bits for most layers, high bits where errors hurt most.
RECIPES: dict[str, tuple[int, int]] = {
    "mixed_2_6": (2, 6),
    "mixed_3_4": (3, 4),
    "mixed_3_6": (3, 6),
    "mixed_4_6": (4, 6),
}
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"

    def as_config(self) -> dict[str, int | str]:
        """The dict mlx-lm writes into ``config.json``'s ``quantization`` key."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def holds(self, src: QuantParams) -> bool:
        """Whether every weight on ``src``'s grid is exactly on this one: the same parameters, or, both
        affine, at least as many bits and groups that split the source's (w = s·q + b keeps its code q
        and the source group's s and b)."""
        if self == src:
            return True
        return (self.mode == src.mode == "affine" and self.bits >= src.bits
                and src.group_size % self.group_size == 0)

    def __str__(self) -> str:
        return f"{self.mode} {self.bits}-bit g{self.group_size}"


def quant_params(mode: str | None, bits: int | None, group_size: int | None) -> QuantParams:
    """Validated parameters; ``None`` takes the mode's default (as mlx-lm does)."""
    mode = mode or "affine"
    if mode not in MODES:
        raise InvalidRequest(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODES)}")
    allowed_bits, allowed_groups, default_bits, default_group = MODES[mode]
    bits = default_bits if bits is None else bits
    group_size = default_group if group_size is None else group_size
    if bits not in allowed_bits:
        raise InvalidRequest(
            f"--q-bits {bits} is not supported by mode {mode} (allowed: {_join(allowed_bits)})"
        )
    if group_size not in allowed_groups:
        raise InvalidRequest(
            f"--q-group-size {group_size} is not supported by mode {mode} (allowed: {_join(allowed_groups)})"
        )
    return QuantParams(group_size, bits, mode)


@dataclass(frozen=True)
class Plan:
    """How every quantizable layer is to be quantized: one default, optionally a recipe."""

    default: QuantParams
    recipe: str | None = None
    num_layers: int = 0

    def params_for(self, path: str) -> QuantParams:
        if self.recipe is None:
            return self.default
        low, high = RECIPES[self.recipe]
        more = high if _wants_more_bits(path, self.num_layers) else low
        return QuantParams(self.default.group_size, more, "affine")


def make_plan(params: QuantParams, recipe: str | None, num_layers: int) -> Plan:
    if recipe is not None:
        if recipe not in RECIPES:
            raise InvalidRequest(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        if params.mode != "affine":
            raise InvalidRequest(f"recipe {recipe} mixes affine bit widths: not for --q-mode {params.mode}")
    return Plan(params, recipe, num_layers)


def _wants_more_bits(path: str, num_layers: int) -> bool:
    """llama.cpp's Q4_K_M choice (``use_more_bits``): embeddings and the head always; v_proj and
    down_proj in the first and last eighth of the layers and every third layer between."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return True
    if leaf not in ("v_proj", "down_proj"):
        return False
    match = _LAYER_INDEX.search(f".{path}.")
    if match is None:
        return False
    i, n = int(match.group(1)), num_layers
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _join(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values))
