"""Structured output: a generation's grammar (an llguidance matcher), the token masks a draft step, a verify pass or a
plain step applies, the token the grammar forces, and rollback of rejected drafts; ``GrammarProcessor`` constrains
plain decoding as a logits processor and hands its grammar to the MTP loops. Design: docs/structured.md."""

from __future__ import annotations

import functools
import json
import time

import mlx.core as mx
import numpy as np

JSON_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}  # as mlx-vlm's server


class GrammarError(ValueError):
    """A response format or grammar that cannot constrain decoding; the message says what is wrong."""


def response_format_grammar(response_format) -> str | None:
    """llguidance grammar text for an OpenAI ``response_format`` (``{"type": "json_schema", "json_schema": {"schema":
    …}}``, ``{"type": "json_object"}``), or None for ``{"type": "text"}`` / None. GrammarError: anything else, or a
    schema llguidance cannot compile."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object, got {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise GrammarError(f"response_format type must be 'json_schema', 'json_object' or 'text', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise GrammarError("response_format json_schema must be an object with a 'schema'")
    return json_schema_grammar(spec["schema"])


def json_schema_grammar(schema) -> str:
    """llguidance grammar text for JSON under ``schema`` (a dict, a bool, or its JSON text), with mlx-vlm's separators.
    GrammarError: not a schema, or one llguidance cannot compile."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not JSON ({e})") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema is an object or a boolean, got {json.dumps(schema)[:80]}")
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_FORMAT)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the JSON schema cannot be compiled: {error}")
    return grammar


class Grammar:
    """One generation's grammar state over a tokenizer (``llguidance.LLTokenizer``); tokens past its vocabulary are
    never allowed. GrammarError on a grammar llguidance refuses."""

    def __init__(self, tokenizer, text: str):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, text)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.tokenizer, self.text = tokenizer, text
        self.words = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        self.consumed = self.committed = 0  # tokens consumed; of them, committed (``commit``)
        self.seconds = 0.0  # host time in the matcher (masks, consumption, rollback)

    def allowed(self) -> mx.array:
        """The tokens (32·W,) bool the grammar allows next (W: the bitmask's words; ``constrain`` fits the width)."""
        import llguidance.numpy

        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.words, 0)
        bits = np.unpackbits(self.words[0].view(np.uint8), bitorder="little").astype(bool)
        self.seconds += time.perf_counter() - start
        return mx.array(bits)

    def forced(self) -> int | None:
        """The next token when the grammar forces it (llguidance's fast-forward tokens), else None."""
        start = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()
        self.seconds += time.perf_counter() - start
        return tokens[0] if tokens else None

    def advance(self, tokens: list[int]) -> None:
        """Consume ``tokens``; those after the grammar's end are ignored (its stop token, a pipelined step past it).
        GrammarError (naming the matcher's error) when one is not allowed."""
        start = time.perf_counter()
        for token in tokens:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")
            self.consumed += 1
        self.seconds += time.perf_counter() - start

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""
        if count and not self.matcher.rollback(count):
            raise GrammarError(f"the grammar cannot roll back {count} tokens: {self.matcher.get_error()}")
        self.consumed -= count

    def keep(self, count: int) -> None:
        """Of the tokens consumed since the last ``commit`` (a cycle's drafts), keep the first ``count`` (a draft past
        the grammar's end was never consumed)."""
        self.rollback(max(self.consumed - self.committed - count, 0))

    def commit(self) -> None:
        """What is consumed now stays: ``restore`` returns here."""
        self.committed = self.consumed

    def restore(self) -> None:
        """Roll back to the last ``commit`` (drafts of a cycle that did not finish)."""
        self.rollback(self.consumed - self.committed)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar would accept from here (nothing consumed)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def walk(self, tokens: list[int]) -> list[mx.array]:
        """Consume ``tokens``, allowed ones; the masks (``allowed``) before each and after the last."""
        masks = [self.allowed()]
        for token in tokens:
            self.advance([token])
            masks.append(self.allowed())
        return masks

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing may follow."""
        return self.matcher.is_stopped()


def constrain(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` (…, V) with the tokens ``allowed`` (…, T) bool forbids set to -inf (tokens past T: forbidden)."""
    width = logits.shape[-1]
    if allowed.shape[-1] < width:
        allowed = mx.pad(allowed, [(0, 0)] * (allowed.ndim - 1) + [(0, width - allowed.shape[-1])])
    return mx.where(allowed[..., :width], logits, mx.array(-mx.inf, logits.dtype))


class GrammarProcessor:
    """An mlx-lm logits processor (``processor(tokens, logits) -> logits``) constraining one generation to grammar
    ``text`` over ``tokenizer`` (``llguidance.LLTokenizer``): its first call sees the prompt, each later call one more
    generated token. The MTP loops take the grammar over instead (``start``), to draft under it."""

    def __init__(self, tokenizer, text: str, grammar: Grammar | None = None):
        self.tokenizer, self.text = tokenizer, text
        self.grammar = grammar
        self.prompt: int | None = None
        self.seen = 0

    @classmethod
    def continuing(cls, grammar: Grammar) -> GrammarProcessor:
        """A processor going on from ``grammar``'s committed state: its first call's tokens are taken as consumed (a
        row an MTP loop hands to stock decoding)."""
        grammar.restore()
        return cls(grammar.tokenizer, grammar.text, grammar)

    def start(self) -> Grammar:
        """A fresh ``Grammar`` of this processor's text."""
        return Grammar(self.tokenizer, self.text)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        tokens = tokens.reshape(-1)  # (N,) or one row (1, N)
        if self.prompt is None:
            self.grammar, self.prompt = self.grammar or self.start(), tokens.size
        else:
            self.grammar.advance(tokens[self.prompt + self.seen:].tolist())
        self.seen = tokens.size - self.prompt
        return constrain(logits, self.grammar.allowed())


def tokenizer_of(tokenizer):
    """The ``llguidance.LLTokenizer`` of a Hugging Face fast tokenizer or of what wraps one (mlx-lm's
    ``TokenizerWrapper``, an mlx-vlm processor); kept per tokenizer (about a second for a 150k vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    for name in ("_tokenizer", "tokenizer"):  # mlx-lm's wrapper, then a processor
        if not isinstance(tokenizer, PreTrainedTokenizerFast) and hasattr(tokenizer, name):
            tokenizer = getattr(tokenizer, name)
    return _llg_tokenizer(tokenizer)


@functools.lru_cache(maxsize=8)
def _llg_tokenizer(hf_tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


def response_format_processor(tokenizer, response_format) -> GrammarProcessor | None:
    """A ``GrammarProcessor`` for an OpenAI ``response_format`` over ``tokenizer`` (``tokenizer_of``); None for text.
    GrammarError as ``response_format_grammar``."""
    text = response_format_grammar(response_format)
    return None if text is None else GrammarProcessor(tokenizer_of(tokenizer), text)


def grammar_of(processors) -> tuple[Grammar | None, list]:
    """``(grammar, processors)``: a generation's processors that are one ``GrammarProcessor`` alone become its
    ``Grammar`` (the processor's own once it was called: it has not consumed the token drawn after that call),
    drafted under by the MTP loops; with other processors the grammar stays a processor among them (the loops then
    call every processor position by position, drafting unconstrained)."""
    processors = list(processors or [])
    if len(processors) == 1 and isinstance(processors[0], GrammarProcessor):
        return processors[0].grammar or processors[0].start(), []  # its own, where a runtime called it already
    return None, processors
