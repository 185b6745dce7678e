"""What a plain `pip install` ships: every package folder of the source tree is in pyproject's list (an
editable install finds a missing one anyway, so only a real install would fail, at import)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: package for package, folder in setuptools["package-dir"].items()}
    found = set()
    for top in ("mlx_infer", "server", "convert", "distributed", "metal_kernels"):
        for init in (ROOT / top).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT).as_posix()
            # The longest folder pyproject maps that holds this one names its package.
            base = max((f for f in folders if relative == f or relative.startswith(f + "/")), key=len)
            rest = relative[len(base) :].strip("/").replace("/", ".")
            found.add(folders[base] + ("." + rest if rest else ""))
    assert found - set(setuptools["packages"]) == set(), "packages missing from pyproject.toml"
