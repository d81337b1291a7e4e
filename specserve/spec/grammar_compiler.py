"""GrammarCompiler: StructuredSpec -> xgrammar CompiledGrammar for one tokenizer, cached.

xgrammar, not llguidance: with this tokenizer it fills a token mask in ~0.005 ms at batch 1 and
~0.009 ms per sequence at batch 32, 3-5x faster than llguidance
(benchmarks/probes/grammar_mask_cost.py, RESULTS.md "Grammar engines: mask time per token").

Compiling a schema takes ~10 ms (more for large schemas) and the tokenizer's set-up ~0.3 s once:
the async engine compiles on its own worker thread before a request reaches the engine thread,
so the step loop only ever finds compiled grammars in the cache. The cache is keyed by the
spec's (kind, text); the tokenizer is this compiler's own. Thread-safe: compiles may run on the
worker while the engine thread reads the cache.

JSON is generated compactly (``any_whitespace=False``: no free whitespace between tokens), so a
small model cannot fill its budget with blank lines, and the forced runs (keys, punctuation) are
longer. ``json_object`` is the schema ``{"type": "object"}``.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from specserve.core.errors import INVALID_STRUCTURED_OUTPUT, InvalidRequestError
from specserve.core.structured import StructuredSpec, choice_grammar

_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[05:30:53] /project/cpp/x.cc:83: "


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's length)
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                if self._tokenizer is None:
                    raise InvalidRequestError(
                        "structured outputs need the model's tokenizer, and this model has none",
                        param="response_format")
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar; raises ``InvalidRequestError`` naming ``spec.param`` when the
        schema, regex or grammar is not valid."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        compiler = self._xgr_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "EBNF grammar",
                    "choice": "choice list", "json_object": "JSON grammar",
                    "structural_tag": "tools' call grammar"}[spec.kind]
            detail = _LOCATION.sub("", str(exc).strip()).strip()
            raise InvalidRequestError(f"the {what} cannot be compiled: {detail}",
                                      param=spec.param, code=INVALID_STRUCTURED_OUTPUT) from exc
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: Any, spec: StructuredSpec) -> Any:
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.text, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.text))
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.text)
        return compiler.compile_grammar(spec.text)
