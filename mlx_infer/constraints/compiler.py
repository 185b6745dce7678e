"""Constraint specs compiled by llguidance for one tokenizer, cached by spec.

llguidance reads the vocabulary from the ``tokenizers`` object's own JSON (``to_str()``), whether the
tokenizer came from a tokenizer.json or was built from GGUF metadata, so its byte-level / SentencePiece
handling is llguidance's, not ours. A compiled constraint keeps one pristine matcher; every request gets
a deep copy (cheaper than parsing the grammar again).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher, LLTokenizer

from mlx_infer.constraints.spec import ConstraintSpec
from mlx_infer.errors import InvalidRequest

CACHE_SIZE = 128  # compiled constraints kept per tokenizer (least recently used go first)
# JSON on one line, spaced as Python's json.dumps: free whitespace lets small models pad answers with
# newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "lark": "Lark grammar",
    "gbnf": "GBNF grammar",
}


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as llguidance sees it: every id the engine stops on ends a grammar alike."""

    ll: LLTokenizer

    @property
    def size(self) -> int:
        return self.ll.vocab_size


@dataclass(frozen=True)
class CompiledConstraint:
    spec: ConstraintSpec
    vocab: Vocabulary
    _matcher: LLMatcher  # in its start state; never advanced

    def new_matcher(self) -> LLMatcher:
        return self._matcher.deep_copy()


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a spec (raises InvalidRequest where llguidance refuses it outright)."""
    try:
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json.loads(spec.key())[1], defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            # Lark string literals are JSON strings: any text is matched literally.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.value)
        # GBNF is converted to Lark (a Lark grammar given as "gbnf" passes through unchanged).
        return llguidance.grammar_from("gbnf", spec.value)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"the {_NAMES[spec.kind]} does not compile: {_one_line(e)}") from None


class ConstraintCompiler:
    """Compiles specs for one tokenizer; thread-safe (the server compiles off its event loop while the
    engine thread takes compiled ones from the cache)."""

    def __init__(self, tokenizer) -> None:
        self.vocab = vocabulary(tokenizer)
        self._cache: OrderedDict[ConstraintSpec, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        # Outside the lock: a large schema takes a while, and llguidance releases the GIL meanwhile.
        matcher = LLMatcher(self.vocab.ll, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"the {_NAMES[spec.kind]} does not compile: {_one_line(matcher.get_error())}"
            )
        compiled = CompiledConstraint(spec, self.vocab, matcher)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compile_constraint(spec: ConstraintSpec, tokenizer) -> CompiledConstraint:
    """``spec`` compiled for ``tokenizer`` (a ``mlx_infer.tokenizer.Tokenizer``), from the cache when the
    same spec was compiled before; raises InvalidRequest naming the problem when it does not compile."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = ConstraintCompiler(tokenizer)
    return compiler.compile(spec)


def vocabulary(tokenizer) -> Vocabulary:
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise InvalidRequest("structured output needs a tokenizer built on the `tokenizers` library")
    # The model's own end-of-sequence token first, then the turn ends the engine also stops on.
    first = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    eos = list(dict.fromkeys(first + sorted(tokenizer.eos_token_ids)))
    if not eos:
        raise InvalidRequest("structured output needs a model with an end-of-sequence token")
    try:
        return Vocabulary(LLTokenizer(backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos))
    except ValueError as e:  # a vocabulary llguidance cannot read (no byte-level or SentencePiece decoder)
        raise InvalidRequest(f"structured output is not available for this model's tokenizer: {e}") from None


def _one_line(error: object) -> str:
    return " ".join(str(error).split())
