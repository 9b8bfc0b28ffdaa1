"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Validation here is what turns a malformed request into a 400 naming the field, instead of an error
deep in the server. Fields of the OpenAI API that weir does not implement are accepted and ignored
when they cannot change the result's meaning (``user``, ``metadata``, ``store``, ...) and rejected
with a message when they would (``tool_choice="required"``, content parts other than text, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Lenient(BaseModel):
    """Unknown fields are kept and ignored: clients send many optional OpenAI fields."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    """An image content part: ``{"type": "image_url", "image_url": {"url": "data:image/png;..."}}``
    (a vision-language model only; remote URLs only when the server allows them)."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments as a dict (the API sends a JSON string); unparsable text is kept raw."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": self.arguments}
        return value if isinstance(value, dict) else {"_raw": self.arguments}


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(p, ImagePart) for p in self.content
        )


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str = ""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # weir extension (vLLM accepts it too)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # OpenAI options weir does not implement: accepted at their no-op values, rejected otherwise, so
    # a client never silently gets something other than what it asked for.
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unimplemented(self) -> _Sampling:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by weir's engine")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by weir's engine (send 0 or omit it)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(
                "response_format: only {'type': 'text'} is supported (weir does not constrain "
                "decoding to a JSON schema)"
            )
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError(
                "top_logprobs: only 0 is supported (weir's engine reports the sampled token's "
                "log-prob, not the top alternatives)"
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError(
                "tool_choice: only 'auto' and 'none' are supported (weir does not constrain "
                "decoding to force a tool call)"
            )
        return self

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise ValueError(
                "logprobs: at most 1 (weir's engine reports the sampled token's log-prob only)"
            )
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    info: dict[str, Any] = Field(default_factory=dict)


class SessionSampling(BaseModel):
    """Sampling a session enforces on every call, whatever the agent asks (see `SessionManager.open`)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(1024, ge=0)
    seed: int | None = None


class OpenSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    row: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SessionSampling | None = None


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None
) -> dict:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}
