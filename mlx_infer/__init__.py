"""mlx-infer: LLM inference on MLX."""

# Must run before anything imports mlx.core: MLX binds its BLAS symbols once, at import.
from mlx_infer import blas as _blas

_blas.setup()
