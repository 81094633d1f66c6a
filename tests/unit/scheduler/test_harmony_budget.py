"""gpt-oss's harmony format as the scheduler enforces it (llmserve.grammar.reasoning), against
the fake model that samples only what each step's mask allows, with the block and the grammar
the gateway sends for it (gateway/reasoning/harmony.py): under a thinking budget and a JSON
schema, every output's analysis message closes within the budget, and its final message is
`<|channel|>final<|message|>` then JSON the schema allows then `<|return|>`.

The tokenizer is SmolLM2's with harmony's tags added as special tokens and `<|return|>` its
EOS; the prompt ends with `<|start|>assistant`, so the first token is `<|channel|>` either
way and the model then picks the analysis channel or the final one."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from gateway.reasoning import HarmonyFormat, ReasoningRequest
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.spec import GrammarSpec
from scheduler_service.engine import SamplingParams
from scheduler_service.engine.sequence import FinishReason
from tests.support.grammar import BOUNDED_SCHEMA, harmony_tokenizer

from .test_grammar import assert_empty, make_engine
from .test_reasoning_budget import run

BUDGET = 12
HEADER = "<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(LLGuidanceBackend)


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def find(ids: list[int], part: list[int]) -> int:
    """Where `part` first occurs in `ids` (-1: nowhere)."""
    for at in range(len(ids) - len(part) + 1):
        if ids[at : at + len(part)] == part:
            return at
    return -1


def test_the_budget_closes_every_analysis_and_the_answer_is_json(tok, cache):
    request = ReasoningRequest(HarmonyFormat(), opened=False, budget=BUDGET)
    schema = GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format")
    grammar = request.answer_grammar(schema)
    spec = request.scheduler_spec(lambda text: text_ids(tok, text), constrained=True)
    assert spec is not None
    opening = text_ids(tok, "<|channel|>analysis<|message|>")
    end = text_ids(tok, "<|end|><|start|>assistant")
    rng = random.Random(5)
    requests = []
    for i in range(24):
        prompt = text_ids(tok, "<|start|>user<|message|>Hi<|end|><|start|>assistant")
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 10))] + prompt
        params = (
            SamplingParams(temperature=0.0, max_tokens=120)
            if i % 2
            else SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=120)
        )
        requests.append((f"r{i}", prompt, params, grammar, spec))
    engine = make_engine(tok, cache)
    results = run(engine, requests, tok.eos_token_id)
    assert_empty(engine)
    thought = answered = 0
    for request_id, *_ in requests:
        for choice in results[request_id].outputs:
            ids = list(choice.token_ids)
            assert choice.finish_reason == FinishReason.STOP, (request_id, ids)
            if ids[: len(opening)] == opening:
                thought += 1
                at = find(ids, end)
                assert at >= 0, tok.decode(ids)
                # The analysis message's text: within the budget.
                assert at - len(opening) <= BUDGET
                ids = ids[at + len(end) :]
            else:
                answered += 1
            text = tok.decode(ids, skip_special_tokens=False)
            assert text.startswith(HEADER) and text.endswith("<|return|>"), text
            jsonschema.validate(json.loads(text[len(HEADER) : -len("<|return|>")]), BOUNDED_SCHEMA)
    # The model took both ways: thinking first, and answering at once.
    assert thought >= 4 and answered >= 4, (thought, answered)
