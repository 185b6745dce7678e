"""Memory planning from a checkpoint's metadata: will it fit, how many sequences at what context, and
how fast can decode be (``mlx-infer plan``, the check at ``serve``'s start, ``models``' FITS column)."""

from mlx_infer.plan.planner import KV_CACHE_DTYPES, Plan, kv_bytes_per_token, make_plan

__all__ = ["KV_CACHE_DTYPES", "Plan", "kv_bytes_per_token", "make_plan"]
