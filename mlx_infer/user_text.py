"""Text typed, piped or loaded by a user, checked before a tokenizer sees it.

Python hands bytes that are not UTF-8 over as lone surrogates (``surrogateescape``: in ``sys.argv``, and
in stdin under a C locale), and JSON may spell half an emoji (``"\\ud83d"``). No tokenizer encodes
either, and no file can hold them as UTF-8: they are refused here with a line that says where.
"""

from __future__ import annotations

from mlx_infer.errors import InvalidRequest

_ESCAPED_BYTES = range(0xDC80, 0xDD00)  # surrogateescape's stand-ins for the bytes 0x80-0xff


def checked_text(text: str, what: str, param: str | None = None) -> str:
    """``text`` when UTF-8 can encode it; InvalidRequest naming ``what`` and the first bad character
    (``param``: the request field it came from, for the server's error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"the byte 0x{code - 0xDC00:02x}" if code in _ESCAPED_BYTES else f"half an emoji (U+{code:04X})"
        raise InvalidRequest(f"{what} is not valid UTF-8 text: {bad} at character {e.start}", param) from None
    return text
