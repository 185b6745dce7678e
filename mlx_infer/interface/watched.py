"""Layers whose parameters native copies bind: a replaced parameter is noticed in O(1) a step.

The native CPU blocks (``models/native_block.py``) bind their layers' arrays once; a parameter replaced
afterwards (assignment, ``update``, ``load_weights``) leaves the bound copy stale, so a block must check
before each step that every parameter it reads is still the array it bound. Checking each one's identity
every step touched ~700 objects for SmolLM2, cold in cache after the kernels ran, and cost 0.16 ms of the
host's time a step (on two cores that comes out of the kernels' time). So the layers those parameters
live in are :class:`Watched`: setting any entry of one (every way MLX's ``Module`` replaces a parameter
goes through ``module[key] = value``) moves :func:`generation`, and a block re-checks identities only
when it moved.
"""

from __future__ import annotations

from typing import Any

_generation = [0]


def generation() -> int:
    """A counter that moves whenever an entry of any :class:`Watched` module is set or deleted."""
    return _generation[0]


class Watched:
    """Mixin for ``nn.Module`` subclasses (before the MLX base in the bases): entries set or deleted move
    :func:`generation`."""

    def __setitem__(self, key: str, value: Any) -> None:
        _generation[0] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        _generation[0] += 1
        super().__delitem__(key)
