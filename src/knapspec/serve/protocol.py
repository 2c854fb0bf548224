"""The OpenAI API subset the server speaks, as pydantic models (OpenAI's field names).

Requests forbid unknown fields, and the fields OpenAI defines that knapspec does not
implement (``n > 1``, ``logprobs``, ``tools``, penalties, ...) are declared so that a value
other than their no-op default is refused with a 400 naming the field: a client never gets
an answer that silently ignored part of its request. Validation errors carry the field's
name as ``param`` (see :mod:`knapspec.serve.app`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The most stop strings a request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4


class UnsupportedFieldError(ValueError):
    """A field knapspec does not implement was given a value that asks for it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` (a last chunk with the usage)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


#: Fields OpenAI defines and knapspec refuses unless they hold a no-op value, with why.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "n > 1 is not supported: send one request per completion"),
    "best_of": ((None, 1), "best_of > 1 is not supported"),
    "logprobs": ((None, False, 0), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "top_logprobs are not supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "presence_penalty": ((None, 0, 0.0), "presence_penalty is not supported"),
    "frequency_penalty": ((None, 0, 0.0), "frequency_penalty is not supported"),
    "logit_bias": ((None,), "logit_bias is not supported"),
    "tools": ((None,), "tools (function calling) are not supported"),
    "tool_choice": ((None, "none"), "tool_choice is not supported"),
    "functions": ((None,), "functions (function calling) are not supported"),
    "function_call": ((None, "none"), "function_call is not supported"),
    "parallel_tool_calls": ((None,), "parallel_tool_calls is not supported"),
    "response_format": ((None,), "response_format is not supported (plain text only)"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
}


class _Request(BaseModel):
    """Fields shared by both generation endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect
    # Declared only to be refused by name unless they hold a no-op value (_UNSUPPORTED).
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        for name, (allowed, message) in _UNSUPPORTED.items():
            if name in self.model_fields_set and getattr(self, name, None) not in allowed:
                raise UnsupportedFieldError(name, message)
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError("stream_options", "stream_options needs stream: true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty strings dropped)."""
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    @model_validator(mode="after")
    def _check_stop(self) -> _Request:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise UnsupportedFieldError(
                "stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int] | list[str]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise UnsupportedFieldError(
                    "prompt", "a list of several prompts is not supported: one prompt a request"
                )
            self.prompt = prompt[0]
        return self


class TextPart(BaseModel):
    """One text part of a message's content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message (text only)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None  # stored-completions metadata; no effect here
    store: bool | None = None  # OpenAI's stored completions; nothing is stored here

    @model_validator(mode="after")
    def _check_messages(self) -> ChatCompletionRequest:
        if not self.messages:
            raise UnsupportedFieldError("messages", "messages must hold at least one message")
        if self.store:
            raise UnsupportedFieldError("store", "store: true is not supported")
        return self


# ---------------------------------------------------------------------------- responses
class Usage(BaseModel):
    """Token counts of one answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


#: "stop" (a stop token or string) or "length" (the token limit).
FinishReason = str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "knapspec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


__all__ = [
    "MAX_STOP_STRINGS",
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "ErrorBody",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "TextPart",
    "UnsupportedFieldError",
    "Usage",
]
