"""The public gRPC API, llmserve.v1.Generation: proto -> GenerationCore -> proto."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc

from gateway.generation import GenerationCore
from gateway.generation_types import (
    ChoiceUpdate,
    GenerationInput,
    GenerationUpdate,
    LogprobEntry,
    Prompt,
    TextOptions,
    TokenInfo,
)
from gateway.grpc_chat import ChatChoices, prepared_chat, rendered_prompt
from gateway.prompts import text_prompt
from gateway.structured_outputs import check_admissible
from llmserve.errors import FieldError
from llmserve.proto_convert import grammar_from_proto, sampling_params_from_proto
from llmserve.telemetry import context_from_metadata
from llmserve.v1 import generation_pb2, generation_pb2_grpc


def _sampling_name(field_name: str) -> str:
    """The request's name for a SamplingParams field (they travel in `sampling_params`)."""
    return f"sampling_params.{field_name}"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def _prompt(self, request: generation_pb2.GenerateRequest) -> Prompt:
        """A text or token-id prompt (a chat's is prepared with its tools: `_input`)."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return await text_prompt(self.core, request.text, "text")
        if kind == "token_ids":
            return self.core.prompt_from_ids(list(request.token_ids.ids), "token_ids.ids")
        raise FieldError("prompt", "set one of text, token_ids or chat")

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        core = self.core
        with core.admission.slot():
            async for response in self._generate(request, context):
                yield response

    async def _input(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> GenerationInput:
        core = self.core
        core.check_model(request.model)
        grammar = None
        if request.HasField("grammar"):
            grammar = grammar_from_proto(request.grammar, "grammar")
        chat = None
        if request.WhichOneof("prompt") == "chat":
            chat = await prepared_chat(core, request.chat, grammar)
            prompt, grammar = chat.prompt, chat.grammar
        else:
            prompt = await self._prompt(request)
            if grammar is not None:
                await check_admissible(grammar, core.limits)
        params = core.sampling_params(
            prompt,
            lambda left: sampling_params_from_proto(
                request.sampling_params, default_max_tokens=left
            ),
            request.stop,
            _sampling_name,
        )
        options = TextOptions(
            stop=tuple(request.stop),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=(
                request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            ),
            detokenize=request.detokenize if request.HasField("detokenize") else True,
        )
        inp = GenerationInput(
            request.request_id or f"grpc-{uuid.uuid4().hex}",
            prompt,
            params,
            options,
            priority=request.priority,
            timeout_s=core.timeout_for(context.time_remaining()),
            grammar=grammar,
        )
        if chat is not None:
            inp.tools, inp.reasoning = chat.tools, chat.reasoning
        return inp

    async def _generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        inp = await self._input(request, context)
        reader = ChatChoices.needed(inp, self.core)
        parent = context_from_metadata(context.invocation_metadata())
        first = True
        async for update in self.core.generate(inp, parent):
            response = _response(inp.request_id, update, reader)
            if first and (request.echo or update.prompt_logprobs):
                if request.echo:
                    response.prompt.text = inp.prompt.text or ""
                    response.prompt.token_ids.extend(inp.prompt.token_ids)
                for entry in update.prompt_logprobs or ():
                    target = response.prompt.logprobs.add()
                    if entry is not None:
                        target.CopyFrom(_logprob(entry))
            first = False
            yield response

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        self.core.check_model(request.model)
        tokenization = self.core.tokenization
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            ids = tokenization.encode(request.text, add_special_tokens=add_special)
        elif kind == "chat":
            ids = (await rendered_prompt(self.core, request.chat)).token_ids
        else:
            raise FieldError("input", "set text or chat")
        reply = generation_pb2.TokenizeResponse(
            token_ids=ids, max_model_len=self.core.max_model_len or 0
        )
        if request.return_token_strings:
            reply.token_strings.extend(tokenization.token_strings(ids))
        return reply

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        core = self.core
        return generation_pb2.ListModelsResponse(
            models=[
                generation_pb2.ModelInfo(
                    id=core.model_name,
                    owned_by="llmserve",
                    created=core.created,
                    max_model_len=core.max_model_len or 0,
                )
            ]
        )


def _token(t: TokenInfo) -> generation_pb2.TextTokenLogprob:
    return generation_pb2.TextTokenLogprob(
        token_id=t.token_id, token=t.text, logprob=t.logprob, rank=t.rank
    )


def _logprob(entry: LogprobEntry) -> generation_pb2.TextOutputLogprob:
    return generation_pb2.TextOutputLogprob(
        token=_token(entry.token), top=[_token(t) for t in entry.top]
    )


def _choice(c: ChoiceUpdate, reader: ChatChoices | None) -> generation_pb2.Choice:
    msg = generation_pb2.Choice(
        index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason
    )
    if reader is not None:
        reader.fill(c, msg)
    if c.logprobs:
        msg.logprobs.extend(_logprob(e) for e in c.logprobs)
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        msg.stop_token_id = c.stop_reason
    return msg


def _response(
    request_id: str, update: GenerationUpdate, reader: ChatChoices | None
) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(
        request_id=request_id, choices=[_choice(c, reader) for c in update.choices]
    )
    if update.usage is not None:
        response.usage.prompt_tokens = update.usage.prompt_tokens
        response.usage.completion_tokens = update.usage.completion_tokens
        response.usage.spec_draft_tokens = update.usage.spec_draft_tokens
        response.usage.spec_accepted_tokens = update.usage.spec_accepted_tokens
        if reader is not None and reader.reasoning_tokens is not None:
            response.usage.reasoning_tokens = reader.reasoning_tokens
    if update.metrics is not None:
        m = update.metrics
        response.timings.first_token_ns = m.first_token_ns
        response.timings.e2e_ns = m.e2e_ns
        response.timings.queue_ns = m.queue_ns
    return response
