"""The harmony reasoning format (gpt-oss): its parser on whole outputs and on the same outputs
fed in two and in single-character pieces at every split point, where the prompt leaves the
output, which templates pick it, and the grammar it frames an answer's grammar with."""

from __future__ import annotations

import json

import pytest

from gateway.reasoning import HarmonyFormat, ReasoningDelta, detect_format, reasoning_format
from llmserve.grammar.llguidance_backend import LLGuidanceBackend, check_grammar
from llmserve.grammar.spec import GrammarKind, GrammarSpec
from tests.support.grammar import harmony_tokenizer
from tests.support.reasoning_parsers import parse as parse_with
from tests.support.reasoning_parsers import parser_tests
from tests.support.templates import template_text

FORMAT = HarmonyFormat()

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

# (output, the prompt opened the block, expected reasoning, expected answer)
CASES = [
    (f"{ANALYSIS}Add 2 and 2.<|end|>{FINAL}It is 4.<|return|>", False, "Add 2 and 2.", "It is 4."),
    # No analysis message: the output begins with the final message's header.
    ("<|channel|>final<|message|>It is 4.<|return|>", False, "", "It is 4."),
    # The prompt opened the analysis message.
    (f"Add them.<|end|>{FINAL}Four.<|return|>", True, "Add them.", "Four."),
    (f"{ANALYSIS}cut short while thinking", False, "cut short while thinking", ""),
    # Cut short inside the answer's header: nothing of the answer yet.
    (f"{ANALYSIS}x<|end|><|start|>assistant<|chan", False, "x", ""),
    (f"{ANALYSIS}x<|end|><|start|>assistant<|channel|>fin", False, "x", ""),
    # No header at all (a prompt that wrote the final header itself): all answer.
    ("Just the answer.<|return|>", False, "", "Just the answer."),
    ("<|sta", False, "", "<|sta"),
    ("", False, "", ""),
    # Text that only looks like the start of a tag stays text.
    (
        f"{ANALYSIS}a <| b < c <|en d<|end|>{FINAL}x <|ret y<|return|>",
        False,
        "a <| b < c <|en d",
        "x <|ret y",
    ),
    # Two analysis messages, kept apart by a newline; whitespace between messages is dropped.
    (
        f"{ANALYSIS}one<|end|>\n<|start|>assistant{ANALYSIS}two<|end|>{FINAL}done<|return|>",
        False,
        "one\ntwo",
        "done",
    ),
    # A constrained final message: the header's <|constrain|> is no text.
    ('<|channel|>final <|constrain|>json<|message|>{"a": 1}<|return|>', False, "", '{"a": 1}'),
    # A commentary message (a preamble) is answer too.
    (
        f"<|channel|>commentary<|message|>Let me see.<|end|>{FINAL}Done.<|return|>",
        False,
        "",
        "Let me see.\nDone.",
    ),
    # Whitespace in the messages is the model's: kept.
    (
        f"{ANALYSIS}  spaced \n<|end|>{FINAL}\n answer <|return|>",
        False,
        "  spaced \n",
        "\n answer ",
    ),
]


test_whole, test_every_split_point, test_one_character_at_a_time = parser_tests(FORMAT, CASES)


def parse(pieces: list[str], opened: bool) -> tuple[str, str]:
    return parse_with(FORMAT, pieces, opened)


def test_headers_and_partial_end_tags_are_held_back_until_decided() -> None:
    parser = FORMAT.parser(opened=False)
    assert parser.feed("<|channel|>anal") == ReasoningDelta()
    assert parser.opening and not parser.in_block
    assert parser.feed("ysis<|message|>Hm") == ReasoningDelta(reasoning="Hm")
    assert parser.in_block and not parser.opening
    assert parser.feed("m.<|e") == ReasoningDelta(reasoning="m.")
    assert parser.feed("nd|><|start|>assistant<|channel|>final") == ReasoningDelta()
    assert not parser.in_block and parser.opening
    assert parser.feed("<|message|>4") == ReasoningDelta(answer="4")
    assert not parser.in_reasoning and not parser.opening


def test_a_header_that_never_ends_is_text() -> None:
    text = "<|start|>" + "x" * 400
    assert parse([text], False) == ("", text)
    assert parse(list(text), False) == ("", text)


def test_where_the_prompt_leaves_the_output() -> None:
    asked = "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
    assert not FORMAT.opened_in(asked) and not FORMAT.closed_in(asked)
    assert FORMAT.opened_in(asked + ANALYSIS)
    assert not FORMAT.closed_in(asked + ANALYSIS)
    final = asked + "<|channel|>final<|message|>"
    assert FORMAT.closed_in(final) and not FORMAT.opened_in(final)
    # Earlier turns' messages open nothing.
    earlier = f"<|start|>assistant{ANALYSIS}x<|end|>{FINAL}y<|return|>" + asked
    assert not FORMAT.opened_in(earlier) and not FORMAT.closed_in(earlier)


def test_the_format_is_read_off_the_template() -> None:
    assert detect_format(template_text("harmony")) == "harmony"
    assert detect_format(template_text("think")) == "think_tags"
    assert reasoning_format("harmony", None).name == "harmony"  # type: ignore[union-attr]
    picked = reasoning_format("auto", template_text("harmony"))
    assert picked is not None and picked.name == "harmony"


# -- the answer's grammar ------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
# (a request's grammar, an answer it allows, one it refuses)
GRAMMARS = [
    (GrammarSpec.json_schema(SCHEMA, "response_format"), '{"n": 4}', '{"n": "4"}'),
    (GrammarSpec.json_object("response_format"), '{"a": [1]}', "[1]"),
    (GrammarSpec.regex(r"[0-9]+/[0-9]+\}", "structured_outputs.regex"), "3/4}", "3/4"),
    (GrammarSpec.choice(["yes}", 'no"'], "structured_outputs.choice"), 'no"', "maybe"),
    (
        GrammarSpec.grammar('start: "{" NUM "}"\nNUM: /[0-9]+/', "structured_outputs.grammar"),
        "{7}",
        "7",
    ),
    (GrammarSpec.grammar('root ::= "x" [0-9]+', "structured_outputs.grammar"), "x12", "y12"),
]


@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(harmony_tokenizer())


def accepts(backend: LLGuidanceBackend, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes the whole of `text` (tokenized with its tags) and ends."""
    matcher = backend.compile(spec).matcher()
    for token in harmony_tokenizer().encode(text, add_special_tokens=False):
        if not matcher.accept(token):
            return False
    return matcher.is_terminated()


@pytest.mark.parametrize(("grammar", "good", "bad"), GRAMMARS)
def test_the_answer_grammar_is_a_final_message(
    backend: LLGuidanceBackend, grammar: GrammarSpec, good: str, bad: str
) -> None:
    framed = FORMAT.answer_grammar(grammar, closed=False)
    assert (framed.kind, framed.field) == (GrammarKind.LARK, grammar.field)
    check_grammar(framed)  # the gateway's admission check takes it
    header = "<|channel|>final<|message|>"
    assert accepts(backend, framed, f"{header}{good}<|return|>")
    assert not accepts(backend, framed, f"{header}{bad}<|return|>")
    # Not without the header, nor the analysis channel's, nor without <|return|>.
    assert not accepts(backend, framed, f"{good}<|return|>")
    assert not accepts(backend, framed, f"<|channel|>analysis<|message|>{good}<|return|>")
    assert not accepts(backend, framed, f"{header}{good}")
    # The prompt wrote the header: the grammar is the message's text alone.
    closed = FORMAT.answer_grammar(grammar, closed=True)
    assert accepts(backend, closed, f"{good}<|return|>")
    assert not accepts(backend, closed, f"{header}{good}<|return|>")


def test_json_answers_keep_the_fixed_layout(backend: LLGuidanceBackend) -> None:
    framed = FORMAT.answer_grammar(GrammarSpec.json_schema(SCHEMA, "response_format"), False)
    header = "<|channel|>final<|message|>"
    assert not accepts(backend, framed, header + json.dumps({"n": 4}, indent=1) + "<|return|>")
