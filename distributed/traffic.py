"""Bytes this rank hands to ``mx.distributed`` collectives and point-to-point sends.

Counted when the graph is built (shapes are known before evaluation), as the payload each call carries:
the wire adds the transport's framing and, for a ring all-reduce, moves about ``2 (n - 1) / n`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Traffic:
    bytes_sent: int = 0
    messages: int = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages += 1
