"""SmolLM3: the Llama layout where some layers skip RoPE (NoPE layers).

``no_rope_layers[i]`` is 1 where layer ``i`` rotates q and k, 0 where it does not; without the list,
every ``no_rope_layer_interval``-th layer is a NoPE layer. A sliding window applies only to the layers
``layer_types`` marks ``sliding_attention`` (by default the NoPE layers, when ``use_sliding_window``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mlx_infer.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    rms_norm_eps: float = 1e-6
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False
    layer_types: list[str] | None = None

    default_rope_theta: ClassVar[float] = 2_000_000.0  # transformers' SmolLM3Config

    def __post_init__(self):
        super().__post_init__()
        if self.no_rope_layers is None:
            interval = self.no_rope_layer_interval
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
        if self.layer_types is None:
            sliding = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = [
                "sliding_attention" if sliding and not self.no_rope_layers[i] else "full_attention"
                for i in range(self.num_hidden_layers)
            ]

    def uses_rope(self, layer_idx: int) -> bool:
        return bool(self.no_rope_layers[layer_idx])

    def window(self, layer_idx: int) -> int | None:
        # transformers' eager and sdpa attention take the mask of the layer's type, whatever
        # use_sliding_window says (only its flash attention reads that flag).
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


# The blocks differ from Llama's only through ModelArgs.uses_rope / window.
Model = llama.Model
