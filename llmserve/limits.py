"""Per-request limits the gateway enforces before a request reaches the scheduler, and the
one rule on prompt length that the gateway and the scheduler's engine both apply.

One frozen dataclass holds every limit with its default; the gateway builds it from its
flags (`--max-n` and so on: the flag is the field name with dashes). Each check raises a
`FieldError` naming the request field at fault and the limit, so a client knows what to change.
The scheduler and the workers apply none of these again (they check only what their own
capacity decides, such as `max_num_seqs`), so a limit raised here is raised end to end:
`--max-logprobs 30` lets 30 alternatives per token through to the workers' sampler.

The defaults follow what vLLM and TGI ship or document: logprobs up to 20 (vLLM's
`max_logprobs`), a 2 MB-class body limit (TGI's `payload_limit`), a handful of stop strings
(OpenAI allows 4; we allow more, but bounded so matching them stays cheap per token).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from llmserve.errors import FieldError
from llmserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Upper bounds on what one request may ask for. None: no limit beyond the model's."""

    # Tokens in one prompt (after the chat template). None: the model's context - 1.
    max_prompt_tokens: int | None = None
    # Tokens to generate per choice. None: whatever the context leaves.
    max_output_tokens: int | None = None
    # Choices returned (n) and sequences sampled (best_of, the beam width for beam search).
    max_n: int = 16
    max_best_of: int = 16
    # Top alternatives per token (logprobs / top_logprobs / prompt_logprobs).
    max_logprobs: int = 20
    # Stop strings per request, and the characters of each: matching costs
    # count x length per generated token, so both are bounded.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    # stop_token_ids per request.
    max_stop_token_ids: int = 64
    # Prompts in one /v1/completions request (a list of prompts).
    max_prompts_per_request: int = 32
    # Bytes of one HTTP request body.
    max_body_bytes: int = 4 * 1024 * 1024
    # Structured output: bytes of a grammar (a JSON schema, regex, choice list, Lark or GBNF
    # text, or the schema built from `tools`), tools per request, and the milliseconds its
    # admission check (a compile without the tokenizer) may take before the request is
    # refused with 429.
    max_grammar_bytes: int = 64 * 1024
    max_tools: int = 64
    max_grammar_check_ms: int = 2000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"{f.name}: must be at least 1, got {value}")


def _over(field_name: str, value: int, limit: int, flag: str) -> FieldError:
    return FieldError(field_name, f"{value} is over this server's limit of {limit} (--{flag})")


def check_sampling(
    limits: RequestLimits, params: SamplingParams, name: Callable[[str], str]
) -> None:
    """Bounds on sampling parameters. `name` maps a SamplingParams field to the request's
    name for it (`sampling_params.n`, `top_logprobs`)."""
    if params.n > limits.max_n:
        raise _over(name("n"), params.n, limits.max_n, "max-n")
    if params.num_sampled > limits.max_best_of:
        raise _over(name("best_of"), params.num_sampled, limits.max_best_of, "max-best-of")
    if limits.max_output_tokens is not None and params.max_tokens > limits.max_output_tokens:
        raise _over(
            name("max_tokens"), params.max_tokens, limits.max_output_tokens, "max-output-tokens"
        )
    for f in ("logprobs", "prompt_logprobs"):
        value = getattr(params, f)
        if value is not None and value > limits.max_logprobs:
            raise _over(name(f), value, limits.max_logprobs, "max-logprobs")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise FieldError(
            name("stop_token_ids"),
            f"{len(params.stop_token_ids)} ids is over this server's limit of "
            f"{limits.max_stop_token_ids} (--max-stop-token-ids)",
        )


def check_stop(limits: RequestLimits, stop: Sequence[str], field_name: str = "stop") -> None:
    """Stop strings: not empty, bounded in count and length."""
    if len(stop) > limits.max_stop_strings:
        raise FieldError(
            field_name,
            f"{len(stop)} stop strings is over this server's limit of "
            f"{limits.max_stop_strings} (--max-stop-strings)",
        )
    for i, s in enumerate(stop):
        if not s:
            raise FieldError(f"{field_name}[{i}]", "stop strings must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise FieldError(
                f"{field_name}[{i}]",
                f"{len(s)} characters is over this server's limit of "
                f"{limits.max_stop_string_chars} (--max-stop-string-chars)",
            )


def check_prompt_count(limits: RequestLimits, count: int, field_name: str = "prompt") -> None:
    if count > limits.max_prompts_per_request:
        raise FieldError(
            field_name,
            f"{count} prompts is over this server's limit of {limits.max_prompts_per_request} "
            "per request (--max-prompts-per-request)",
        )


def check_prompt_tokens(limits: RequestLimits, num_tokens: int, field_name: str) -> None:
    if limits.max_prompt_tokens is not None and num_tokens > limits.max_prompt_tokens:
        raise FieldError(
            field_name,
            f"the prompt has {num_tokens} tokens, over this server's limit of "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)",
        )


def prompt_too_long(prompt_len: int, max_model_len: int) -> str | None:
    """Why a prompt of `prompt_len` tokens cannot run in a context of `max_model_len` tokens,
    or None when it can. A prompt must leave room for at least one generated token: that
    token takes position `prompt_len`, which the context must hold. So a prompt of exactly
    `max_model_len` tokens is refused, as vLLM refuses it (its serving layer and its engine
    both require prompt + at least one token to fit)."""
    if prompt_len < max_model_len:
        return None
    return (
        f"the prompt has {prompt_len} tokens; the model's context (max_model_len) is "
        f"{max_model_len} tokens, so the prompt must be shorter to leave room for a "
        "generated token"
    )


def check_prompt_fits(prompt_len: int, max_model_len: int, field_name: str) -> None:
    """`prompt_too_long` as a `FieldError` naming `field_name`."""
    reason = prompt_too_long(prompt_len, max_model_len)
    if reason is not None:
        raise FieldError(field_name, reason)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RequestLimits field (`--max-n`), defaulting to the field's default."""
    group = parser.add_argument_group("request limits", "per-request bounds (400 naming the field)")
    for f in fields(RequestLimits):
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=int,
            default=f.default,
            help=f"default: {f.default if f.default is not None else 'the model'}",
        )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
