"""The llguidance backend against the SmolLM2 tokenizer: compiling, refusing, matching, and
the mask encodings a step carries."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import jsonschema
import pytest

from llmserve.grammar.backend import GrammarError
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend, check_grammar
from llmserve.grammar.masks import encode_mask
from llmserve.grammar.spec import GrammarKind, GrammarSpec
from llmserve.steps import MaskKind
from tests.support.grammar import BOUNDED_SCHEMA, smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    return LLGuidanceBackend(tok)


def allowed(matcher, vocab: int) -> list[int]:
    return encode_mask(0, matcher.bitmask(), vocab).allowed_ids()


def walk(backend, tok, spec: GrammarSpec, text: str):
    """A matcher fed `text`'s tokens one by one; asserts each was allowed by the mask."""
    matcher = backend.compile(spec).matcher()
    for token_id in tok.encode(text):
        assert token_id in allowed(matcher, backend.vocab_size), tok.decode([token_id])
        assert matcher.accept(token_id), matcher.error()
    return matcher


def test_json_schema_accepts_a_valid_document_and_terminates(backend, tok):
    doc = {"color": "red", "count": 3, "ok": True, "code": "ABC", "tags": ["a"], "size": {"w": 7}}
    jsonschema.validate(doc, BOUNDED_SCHEMA)
    spec = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")
    matcher = walk(backend, tok, spec, json.dumps(doc))
    assert matcher.is_terminated()
    assert matcher.error() == ""


def test_json_schema_refuses_an_invalid_value(backend, tok):
    spec = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")
    matcher = backend.compile(spec).matcher()
    prefix = tok.encode('{"color": "')
    for t in prefix:
        assert matcher.accept(t)
    purple = tok.encode("purple")[0]
    assert purple not in allowed(matcher, backend.vocab_size)
    copy = matcher.copy()
    assert not matcher.accept(purple)
    assert matcher.error()
    # The copy taken before the bad token is unaffected.
    assert copy.error() == "" and copy.accept(tok.encode("red")[0])


def test_forced_tokens_are_the_schema_punctuation(backend, tok):
    spec = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")
    matcher = backend.compile(spec).matcher()
    forced = matcher.forced_tokens()
    assert tok.decode(forced) == '{"color": "'


def test_choice_regex_lark_gbnf(backend, tok):
    m = walk(backend, tok, GrammarSpec.choice(["yes", "no"], "structured_outputs.choice"), "no")
    assert m.is_terminated()
    m = walk(
        backend, tok, GrammarSpec.regex(r"[0-9]{3}-[a-z]{2}", "structured_outputs.regex"), "123-ab"
    )
    assert m.is_terminated()
    lark = GrammarSpec.grammar('start: "x" NUM\nNUM: /[0-9]/', "structured_outputs.grammar")
    assert lark.kind == GrammarKind.LARK
    assert walk(backend, tok, lark, "x7").is_terminated()
    gbnf = GrammarSpec.grammar('root ::= "x" [0-9]', "structured_outputs.grammar")
    assert gbnf.kind == GrammarKind.GBNF
    assert walk(backend, tok, gbnf, "x7").is_terminated()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            GrammarSpec.json_schema(
                {"type": "object", "properties": {"x": {"not": {}}}}, "response_format"
            ),
            "cannot be enforced",
        ),
        (
            GrammarSpec.json_schema(
                {"type": "string", "format": "no-such-format"}, "response_format"
            ),
            "cannot be enforced",
        ),
        # The schema's own llguidance options cannot relax it.
        (
            GrammarSpec.json_schema(
                {
                    "type": "object",
                    "x-guidance": {"lenient": True},
                    "properties": {"x": {"not": {}}},
                },
                "response_format",
            ),
            "cannot be enforced",
        ),
        (GrammarSpec.regex("[a-", "structured_outputs.regex"), "cannot be compiled"),
        (
            GrammarSpec.grammar("start: undefined_rule", "structured_outputs.grammar"),
            "cannot be compiled",
        ),
    ],
)
def test_unenforceable_or_malformed_grammars_name_the_field(backend, spec, words):
    with pytest.raises(GrammarError) as exc:
        check_grammar(spec)
    assert exc.value.field == spec.field
    assert words in exc.value.detail
    with pytest.raises(GrammarError) as exc:
        backend.compile(spec)
    assert exc.value.field == spec.field


def test_spec_constructors_refuse_bad_shapes():
    from llmserve.errors import FieldError

    with pytest.raises(FieldError, match="response_format"):
        GrammarSpec.json_schema("{not json", "response_format")
    with pytest.raises(FieldError, match="choice"):
        GrammarSpec.choice([], "structured_outputs.choice")
    with pytest.raises(FieldError, match="regex"):
        GrammarSpec.regex("", "structured_outputs.regex")
    # A schema given as text or as an object is the same grammar (one cache entry).
    a = GrammarSpec.json_schema({"a": 1, "b": 2}, "f")
    assert a.source == GrammarSpec.json_schema('{"a": 1,  "b": 2}', "f").source


def test_cache_compiles_once_per_grammar_and_tokenizer(tok):
    built = []

    def factory(t):
        built.append(t)
        return LLGuidanceBackend(t)

    observed = []
    cache = GrammarCache(factory, on_compile=lambda s, ok: observed.append(ok))
    spec = GrammarSpec.regex("[ab]+", "f")
    g1 = cache.get(tok, spec)
    g2 = cache.get(tok, GrammarSpec.regex("[ab]+", "other_field"))
    assert g1 is g2 and len(built) == 1 and (cache.hits, cache.misses) == (1, 1)
    bad = GrammarSpec.regex("[a-", "f")
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.get(tok, bad)
    assert observed == [True, False]  # the failure is cached too


def test_replicas_warming_up_at_once_build_one_backend(tok):
    """Each replica's warm-up asks for the backend; built twice at once, the builds held the
    GIL for seconds while the scheduler's loop had renewals to answer."""
    built = []
    both_asking = threading.Barrier(2)

    def factory(t):
        built.append(t)
        time.sleep(0.2)  # the other thread asks meanwhile
        return LLGuidanceBackend(t)

    cache = GrammarCache(factory)
    backends = []

    def warm() -> None:
        both_asking.wait()
        backends.append(cache.backend(tok))

    threads = [threading.Thread(target=warm) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and len(backends) == 2 and backends[0] is backends[1]


def test_mask_encodings_are_the_smallest_and_round_trip():
    vocab = 1000

    def bitmap(ids):
        b = bytearray((vocab + 31) // 32 * 4)
        for t in ids:
            b[t >> 3] |= 1 << (t & 7)
        return bytes(b)

    few = [3, 17, 999]
    m = encode_mask(5, bitmap(few), vocab)
    assert (m.kind, m.token_ids, m.allowed_ids()) == (MaskKind.ALLOW, few, few)
    most = [t for t in range(vocab) if t not in (4, 500)]
    m = encode_mask(5, bitmap(most), vocab)
    assert (m.kind, m.token_ids, m.allowed_ids()) == (MaskKind.DENY, [4, 500], most)
    half = list(range(0, vocab, 2))
    m = encode_mask(5, bitmap(half), vocab)
    assert m.kind == MaskKind.BITMAP and m.allowed_ids() == half
    assert len(m.bitmap) == 125


@pytest.mark.parametrize("vocab", [31, 33, 1000, 1001, 49152, 49153])
@pytest.mark.parametrize("density", [0.001, 0.02, 0.5, 0.98, 0.999])
def test_mask_encoding_lists_exactly_the_set_bits(vocab, density):
    import random

    rng = random.Random(vocab * 1000 + int(density * 1000))
    size = (vocab + 31) // 32 * 4
    bitmask = bytearray(size)
    for t in range(size * 8):  # bits past the vocabulary too: they must be ignored
        if rng.random() < density:
            bitmask[t >> 3] |= 1 << (t & 7)
    expected = [t for t in range(vocab) if bitmask[t >> 3] >> (t & 7) & 1]
    mask = encode_mask(7, bytes(bitmask), vocab)
    assert mask.allowed_ids() == expected
    assert mask.seq_id == 7 and mask.vocab_size == vocab


def test_importing_the_backend_leaves_transformers_unloaded():
    """The scheduler imports the backend when it builds a replica's engine, on its event loop;
    transformers (about a second to import) loads only with a tokenizer, off that loop."""
    code = (
        "import sys\n"
        "import scheduler_service.__main__\n"
        "from scheduler_service.engine.grammar_requests import default_grammar_cache\n"
        "default_grammar_cache()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
