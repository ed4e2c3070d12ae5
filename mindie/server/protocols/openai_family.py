"""The OpenAI family: chat, completions and the Responses API over one error shape, and the model
list. Its parts live in openai_chat, openai_completions and openai_responses; this is its table."""

from __future__ import annotations

from typing import Any

from mindie.server.errors import ErrorStyle
from mindie.server.protocols import openai_chat, openai_completions, openai_responses
from mindie.server.protocols.base import sse
from mindie.server.protocols.family import Family, Kind, Prompt, Route, chat_prompt, plain_prompt
from mindie.server.protocols.openai import get_model, list_models
from mindie.server.protocols.responses_request import ResponsesRequest


def _prompt(body: dict[str, Any]) -> Prompt | None:
    """The chat's messages, or the first prompt of a completions batch."""
    if "messages" in body:
        return chat_prompt(body)
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return plain_prompt(prompt[0] if batch else prompt)


FAMILY = Family("openai", ErrorStyle.OPENAI, sse, _prompt, routes=(
    Route("POST", "/v1/chat/completions", Kind.GENERATE, openai_chat.parse, stream=None,
          body_model=openai_chat.ChatRequest, summary="OpenAI chat"),
    Route("POST", "/v1/completions", Kind.GENERATE, openai_completions.parse, stream=None,
          body_model=openai_completions.CompletionRequest, summary="OpenAI completions"),
    # The response store lives in the one process that answered: a prefill/decode pair cannot keep it.
    Route("POST", "/v1/responses", Kind.GENERATE, openai_responses.parse, stream=None, body_model=ResponsesRequest,
          summary="OpenAI Responses", disaggregated=False, wrap=openai_responses.create_route),
    Route("GET", "/v1/responses/{response_id}", Kind.CONTROL, handler=openai_responses.get_response),
    Route("DELETE", "/v1/responses/{response_id}", Kind.CONTROL, handler=openai_responses.delete_response),
    Route("GET", "/v1/models", Kind.INFO, handler=list_models),
    Route("GET", "/v1/models/{model}", Kind.INFO, handler=get_model),
))
