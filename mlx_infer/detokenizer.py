"""Incremental detokenization: text out one token at a time, equal in the end to a full decode.

The scheme is the one of HF text-generation-inference and vLLM: decode only a small window of recent
tokens, ``tokens[prefix:]``, and emit what it adds over ``tokens[prefix:read]``, which was already sent.
Decoding a window instead of the whole sequence keeps each step O(window); comparing two decodes of the
same window (rather than slicing one) keeps decoder effects at the window start, such as SentencePiece's
stripped leading space, out of the emitted text.
"""

from __future__ import annotations

import tokenizers

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with ``add``; concatenating every return value and ``flush()`` gives ``decode(ids)``."""

    def __init__(self, backend: tokenizers.Tokenizer, *, skip_special_tokens: bool = False,
                 byte_token_ids: frozenset[int] = frozenset()) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        # Byte-fallback tokens (<0xNN>): the ByteFallback decoder turns a whole run of them into text or into
        # one U+FFFD per byte, so a run may only be emitted once it has ended.
        self._byte_ids = byte_token_ids
        self._tokens: list[int] = []  # the window; its first `read` tokens were emitted already
        self._read = 0
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty, never half a character)."""
        self._tokens.append(token_id)
        if token_id in self._byte_ids:
            return ""
        text = self._decode(self._tokens)
        # A trailing U+FFFD is a character whose bytes have not all arrived yet (or never will: then
        # flush() sends it).
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(self._prefix_text):]
        # The emitted tokens [prefix:read] become the context of the next window, unless they decode to
        # nothing (a skipped special token): a window must start with visible text, or a decoder that strips
        # the first space of its output would strip the next token's space.
        context = self._tokens[self._read:]
        context_text = self._decode(context)
        if context_text:
            self._tokens, self._prefix_text = context, context_text
        else:
            self._prefix_text = text
        self._read = len(self._tokens)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes to U+FFFD here)."""
        if len(self._tokens) == self._read:
            return ""
        text = self._decode(self._tokens)
        new_text = text[len(self._prefix_text):]
        # Everything counts as sent now; the window stays as context in case more tokens follow.
        self._prefix_text, self._read = text, len(self._tokens)
        return new_text
