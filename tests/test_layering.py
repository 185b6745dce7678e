"""The attention interface is a leaf: kernels and the interface import no model or engine code."""

from __future__ import annotations

import subprocess
import sys

import pytest

LEAVES = [
    "mlx_infer.interface.batch",
    "mlx_infer.interface.kv",
    "mlx_infer.interface.state",
    "mlx_infer.cpu_kernels",
    "mlx_infer.metal_kernels.dispatch",
    "mlx_infer.metal_kernels.reference",
    "mlx_infer.metal_kernels.paged_attention",
    "mlx_infer.metal_kernels.replay",
]


@pytest.mark.parametrize("module", LEAVES)
def test_module_imports_no_models_or_engine(module):
    # A fresh interpreter: this process has imported everything already.
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.startswith(('mlx_infer.models', 'mlx_infer.engine'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{module} pulls in {out.strip()}"
