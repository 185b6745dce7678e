"""Kimi's tokenizer (Kimi K2 and Moonshot's other models): a tiktoken rank file, no tokenizer.json.

Their folders ship ``tiktoken.model`` (``<base64 token bytes> <rank>`` a line) and ``tokenization_kimi.py``,
remote code that is not run here. What that code does is small and fixed: tiktoken's byte-level BPE
over the ranks, after splitting the text with :data:`KIMI_PATTERN`, with the special tokens of
``tokenizer_config.json``'s ``added_tokens_decoder`` on the ids past the ranks (256 of them, the unnamed
ones ``<|reserved_token_{id}|>``). The ranks become an equivalent ``tokenizers`` BPE as transformers'
``TikTokenConverter`` builds it: every token's vocabulary id is its rank, a merge for each split of a
token into two tokens, in the order of the merged token's rank (tiktoken merges the adjacent pair whose
concatenation ranks lowest), and whole pieces found in the vocabulary taken as they are.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.tokenizer_gguf import bytes_to_unicode

RANKS_FILE = "tiktoken.model"
RESERVED_SPECIAL = 256  # ids past the ranks that tokenization_kimi.py names
# tokenization_kimi.py's TikTokenTokenizer.pat_str (Han runs on their own; `&&` is a class intersection).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def is_kimi_folder(folder: Path, config: dict[str, Any]) -> bool:
    """A folder whose tokenizer is ``tokenization_kimi.py``'s (its file, or the config pointing at it)."""
    auto_map = str(config.get("auto_map", ""))
    return (folder / RANKS_FILE).is_file() and (
        (folder / "tokenization_kimi.py").is_file() or "tokenization_kimi" in auto_map
    )


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise InvalidCheckpoint(f"{path}:{n}: not a '<base64 token> <rank>' line") from None
    return ranks


def kimi_backend(folder: Path, config: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers`` equivalent of the folder's TikTokenTokenizer."""
    ranks = read_ranks(folder / RANKS_FILE)
    spell = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = sorted(
            ((left, right) for left, right in splits if left in ranks and right in ranks),
            key=lambda p: (ranks[p[0]], ranks[p[1]]),
        )
        merges.extend((rank, left, right) for left, right in pairs)
    merges.sort(key=lambda m: m[0])
    backend = Tokenizer(
        BPE({text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for _, a, b in merges],
            fuse_unk=False, ignore_merges=True)
    )  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Added in id order, each gets the next id: the ids tokenization_kimi.py gives them.
    named = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
    first = len(ranks)
    if any(i < first for i in named):
        raise InvalidCheckpoint(f"{folder}: special token ids overlap the {first} ranks of {RANKS_FILE}")
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(first, first + RESERVED_SPECIAL)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if [backend.token_to_id(t) for t in specials] != list(range(first, first + RESERVED_SPECIAL)):
        raise InvalidCheckpoint(f"{folder}: tokenizer_config.json's special tokens collide with {RANKS_FILE}")
    return backend
