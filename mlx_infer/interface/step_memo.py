"""Per-step values shared by every layer: computed by the first layer that needs them, reused by the rest.

A decode step runs the same derived arrays through every layer (RoPE cos/sin of the step's positions,
the attention mask of its metadata). Building them once per step instead of once per layer removes
hundreds of small MLX ops from the step's graph, which matters on the CPU backend where each op costs
microseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


class StepMemo:
    """Values keyed by ``key``, valid for as long as the step's ``owner`` object is the same.

    ``owner`` (the step's metadata or positions array) is held strongly, so its ``id`` cannot be reused
    by a later step's object while the memo refers to it; a new owner drops the old values. Per thread,
    so engines stepping on different threads never see each other's values.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, owner: object, key: Hashable, make: Callable[[], Any]) -> Any:
        local = self._local
        if getattr(local, "owner", None) is not owner:
            local.owner, local.values = owner, {}
        values = local.values
        if key not in values:
            values[key] = make()
        return values[key]
