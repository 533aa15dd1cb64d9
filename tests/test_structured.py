"""Structured output (``response_format``, ``decoding/grammar.py``): MTP under a JSON schema decodes exactly what
constrained plain decoding does (stock mlx-lm with the same grammar as a logits processor), alone and in the server's
batch beside free rows; drafts are made under the grammar (forced tokens, masked head drafts); sampling keeps the
constrained distribution; every answer validates against its schema."""

import importlib
import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import to_float32
from helpers.console_runs import HF
from mlx_lm import generate, load, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mtp_plugin.adapters.mlx_lm_server import MTPRequest
from scipy.stats import chi2_contingency
from test_batching import drain, insert, mtp_generator, stock_tokens

import mtp_plugin
from mtp_plugin.decoding.grammar import GrammarError

PROMPT = "def read_config(path):\n"
SCHEMAS = {  # bounded, so that the tiny model's repetitive text completes them within MAX_TOKENS
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "maximum": 99}, "email": {"type": "string", "maxLength": 10}},
        "required": ["id", "email"], "additionalProperties": False}, "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer",
                                                                                          "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L", "XL"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "tool-call": {"type": "object", "properties": {
        "name": {"enum": ["read_file", "write_file", "run"]},
        "arguments": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 16},
                                                       "line": {"type": "integer", "maximum": 999}},
                      "required": ["path", "line"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
}
MAX_TOKENS = 120


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.fixture(scope="module")
def trained():
    """The bundled trained checkpoint in float32 (exact greedy comparisons), and its tokenizer."""
    model, tokenizer = load(str(HF))
    return to_float32(model), tokenizer


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_constrained_mtp_is_constrained_plain_decoding(trained, name):
    model, tokenizer = trained
    plain = generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, enable_mtp=False,
                     response_format=json_schema(name))
    jsonschema.validate(json.loads(plain), SCHEMAS[name])  # completed within MAX_TOKENS, and valid
    forced = 0
    for depth, lookup in ((1, False), (3, False), (2, True), (None, True)):
        text = generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, mtp_depth=depth, mtp_lookup=lookup,
                        response_format=json_schema(name))
        stats = model.mtp_head.stats
        assert text == plain, (depth, lookup, stats.summary())
        forced += stats.forced
        assert stats.drafted + stats.lookup_drafted > 0
    assert forced > 0  # keys and punctuation the schema fixes are drafted without the head


def test_the_grammar_steers_the_heads_drafts(trained):
    """Under the grammar the head's drafts are accepted more often than the same head's free drafts would be by a
    trunk constrained after the fact: forced tokens are always accepted, masked drafts are allowed ones."""
    model, tokenizer = trained
    generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, mtp_depth=2, mtp_lookup=False,
             response_format=json_schema("tool-call"))
    stats = model.mtp_head.stats
    assert stats.forced > 0 and stats.masked > 0, stats.summary()
    assert stats.acceptance > 0.5, stats.summary()
    assert "grammar: forced=" in stats.summary()


def test_json_object_and_text_formats(trained):
    model, tokenizer = trained
    text = "".join(r.text for r in stream_generate(model, tokenizer, PROMPT, max_tokens=80, mtp_depth=2,
                                                   response_format={"type": "json_object"}))
    plain = generate(model, tokenizer, PROMPT, max_tokens=80, enable_mtp=False, response_format={"type": "json_object"})
    assert text == plain and plain.startswith("{")
    free = generate(model, tokenizer, PROMPT, max_tokens=20, enable_mtp=False)
    assert generate(model, tokenizer, PROMPT, max_tokens=20, response_format={"type": "text"}) == free


@pytest.mark.parametrize("response_format,says", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be an object with a 'schema'"),
    ({"type": "xml"}, "'json_schema', 'json_object' or 'text'"),
    ("json", "must be an object"),
])
def test_a_bad_response_format_is_refused(trained, response_format, says):
    model, tokenizer = trained
    with pytest.raises(GrammarError, match=says):
        generate(model, tokenizer, PROMPT, max_tokens=4, response_format=response_format)


def test_a_grammar_that_cannot_finish_stops_at_max_tokens(trained):
    model, tokenizer = trained
    unbounded = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]}}}
    responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=24, response_format=unbounded))
    assert len(responses) == 24 and responses[-1].finish_reason == "length"
    assert "".join(r.text for r in responses) == generate(model, tokenizer, PROMPT, max_tokens=24, enable_mtp=False,
                                                          response_format=unbounded)


def test_the_processor_alone_constrains_stock_mlx_lm(trained):
    """``mtp_plugin.response_format_processor`` is an ordinary logits processor: stock mlx-lm (the plugin off) decodes
    the same text with it as MTP does; beside another processor it still constrains (drafts then unconstrained)."""
    model, tokenizer = trained
    with_mtp = generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, mtp_depth=2,
                        logits_processors=[mtp_plugin.response_format_processor(tokenizer, json_schema("enum"))])
    penalty = make_logits_processors(repetition_penalty=1.2)
    mixed = generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, mtp_depth=2, logits_processors=[
        *penalty, mtp_plugin.response_format_processor(tokenizer, json_schema("enum"))])
    mtp_plugin.unpatch()  # conftest's autouse fixture patches again afterwards
    stock = importlib.import_module("mlx_lm.generate").generate
    assert stock(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, logits_processors=[
        mtp_plugin.response_format_processor(tokenizer, json_schema("enum"))]) == with_mtp
    assert stock(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS, logits_processors=[
        *penalty, mtp_plugin.response_format_processor(tokenizer, json_schema("enum"))]) == mixed
    jsonschema.validate(json.loads(mixed), SCHEMAS["enum"])


@pytest.mark.parametrize("depth", [1, 3, 0])
def test_constrained_and_free_rows_in_one_batch_decode_as_stock(trained, depth):
    """The server's batch: constrained rows (two schemas) beside free ones, one constrained row with MTP off; each
    decodes what mlx-lm's own batch decodes with the grammar as a logits processor."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in (PROMPT, "import os\n", "class A:\n", "x = [1, 2,", "def f(", "# a\n")]
    max_tokens = [MAX_TOKENS, 30, MAX_TOKENS, 40, MAX_TOKENS, 25]
    formats = {0: json_schema("flat"), 2: json_schema("tool-call"), 4: json_schema("array")}

    def processors():
        return [[mtp_plugin.response_format_processor(tokenizer, formats[i])] if i in formats else []
                for i in range(len(prompts))]

    options = [MTPRequest(True, depth), MTPRequest(True, depth), MTPRequest(True, depth), MTPRequest(True, depth),
               MTPRequest(False), MTPRequest(True, depth)]
    generator = mtp_generator(model)
    uids = insert(generator, prompts, max_tokens, options, processors())
    results = {}
    drain(generator, results)
    expected = stock_tokens(model, prompts, max_tokens, processors())
    assert [results[uid] for uid in uids] == expected
    if depth:
        assert options[0].stats.forced > 0 and options[2].stats.drafted > 0
    for i in formats:
        text = tokenizer.decode([t for t in expected[i] if t not in tokenizer.eos_token_ids])
        jsonschema.validate(json.loads(text), SCHEMAS[formats[i]["json_schema"]["name"]])


def test_sampled_constrained_mtp_keeps_the_constrained_distribution(trained):
    """At temperature 1 under an integer schema, the values MTP samples follow the distribution constrained plain
    decoding samples (chi-square test of homogeneity, 400 generations each)."""
    model, tokenizer = trained
    number = {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 0, "maximum": 40}}}
    sampler = make_sampler(temp=1.0)

    def values(**options):
        mx.random.seed(7)
        return [generate(model, tokenizer, PROMPT, max_tokens=6, sampler=sampler, response_format=number, **options)
                for _ in range(400)]

    with_mtp, plain = values(mtp_depth=2), values(enable_mtp=False)
    table = {v: [with_mtp.count(v), plain.count(v)] for v in set(with_mtp) | set(plain)}
    common = np.array([c for c in table.values() if sum(c) >= 10])
    rare = np.array([c for c in table.values() if sum(c) < 10]).sum(axis=0) if len(common) < len(table) else None
    counts = common if rare is None else np.vstack([common, rare])
    assert len(counts) >= 3, table  # the test has something to compare
    assert chi2_contingency(counts).pvalue > 0.001, table
    assert all(0 <= int(v) <= 40 for v in with_mtp)
