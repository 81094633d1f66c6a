"""Chat templates written for the tests, in the styles of models whose templates render
tools (Hermes / Qwen: `hermes.jinja`; Llama 3: `llama3.jinja`) and that think (`think.jinja`:
`<think>` blocks as Qwen3 and DeepSeek-R1 write them), over SmolLM2's turn markers so that
the real SmolLM2 tokenizer and model can run them; and `harmony.jinja`, gpt-oss's message
headers, for SmolLM2's tokenizer with harmony's tags added (tests/support/grammar.py)."""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).parent


def template_path(name: str) -> Path:
    return DIRECTORY / f"{name}.jinja"


def template_text(name: str) -> str:
    return template_path(name).read_text()
