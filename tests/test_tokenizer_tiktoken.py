"""Kimi's tiktoken tokenizer (``tiktoken.model`` + ``tokenization_kimi.py``, no tokenizer.json) against
tiktoken's own algorithm, written out here: split with Kimi's pattern, then in each piece merge the
adjacent pair whose concatenation ranks lowest until none is a token."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mlx_infer.tokenizer import Tokenizer
from mlx_infer.tokenizer_tiktoken import KIMI_PATTERN, RESERVED_SPECIAL

regex = pytest.importorskip("regex")
SPLIT = regex.compile("(?V1)" + KIMI_PATTERN)  # V1: the `&&` class intersections, as tiktoken's regex
CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's the fox's den; they'll see what we've done.\n"
    "HTTPServer and XMLHttpRequest handle JSON. 1234567 + 89 = 1234656!\n\n"
    "今天天气很好，我们去公园散步吧。机器学习和深度学习。\n"
    "def main():\n    return [x * 2 for x in range(10)]  # doubled\r\n"
) * 3
TEXTS = [
    "The lazy dog's HTTPServer isn't 12345678 apples.\n\n  Don'T STOP",
    "你好世界，今天天气很好。abc中文ABC学习",
    "x = [1, 2, 3]  # comment\r\n\tindent   trailing   ",
    "émigré naïve café — ÜBER straße; 🙂👍🏽 <|im_end|> after",
]


def tiktoken_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    ids = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            ids.append(specials[part])
            continue
        for piece in SPLIT.findall(part):
            parts = [bytes([b]) for b in piece.encode()]
            if piece.encode() in ranks:
                parts = [piece.encode()]
            none = len(ranks)  # the rank of a pair that is no token
            while len(parts) > 1:
                rank, i = min((ranks.get(parts[i] + parts[i + 1], none), i) for i in range(len(parts) - 1))
                if rank == none:
                    break
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            ids.extend(ranks[p] for p in parts)
    return ids


def train_ranks(corpus: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE as tiktoken files hold one: the 256 bytes (ranks in a shuffled order), then each
    merge of the most frequent adjacent pair within the pieces, ranked in the order learned."""
    order = np.random.default_rng(0).permutation(256)
    ranks = {bytes([int(b)]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([b]) for b in p.encode()) for p in SPLIT.findall(corpus))
    for _ in range(merges):
        pairs = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> tuple[Path, dict[bytes, int], dict[str, int]]:
    folder = tmp_path_factory.mktemp("kimi")
    ranks = train_ranks(CORPUS, 300)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    first = len(ranks)
    named = {first: "[BOS]", first + 1: "[EOS]", first + 2: "<|im_end|>", first + 5: "<|im_user|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in named.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
    }))  # fmt: skip
    return folder, ranks, {t: i for i, t in named.items()}


def test_kimi_tokenizer_encodes_as_tiktoken(kimi_folder):
    folder, ranks, specials = kimi_folder
    tok = Tokenizer.from_folder(folder)
    assert len(ranks) > 256 + 150  # merges were learned (till every piece of the corpus is one token)
    for text in TEXTS:
        want = tiktoken_encode(text, ranks, specials)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want) == text


def test_kimi_special_tokens_take_the_ids_past_the_ranks(kimi_folder):
    folder, ranks, specials = kimi_folder
    tok = Tokenizer.from_folder(folder)
    first = len(ranks)
    assert (tok.bos_token_id, tok.eos_token_id) == (first, first + 1)
    assert tok.backend.token_to_id(f"<|reserved_token_{first + 3}|>") == first + 3
    assert tok.vocab_size == first + RESERVED_SPECIAL
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS
