"""The one place that chooses between a Metal kernel and its pure-MLX reference.

Off Metal the reference is chosen silently; on Metal the kernel, unless
``MLX_INFER_KERNELS=reference``.
"""

from __future__ import annotations

from mlx_infer.metal_kernels import reference

paged_attention = reference.paged_attention
