"""Request schemas of the OpenAI API subset mlx-infer serves (validated with pydantic)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlx_infer.context_policy import Policy
from mlx_infer.errors import InvalidRequest
from mlx_infer.sampling import SamplingParams
from mlx_infer.server.null_defaults import NullMeansDefault
from mlx_infer.server.structured import StructuredOutputFields

INT32_MAX = 2**31 - 1
MAX_STOP_LENGTH = 1024  # characters per stop string: the matcher holds back up to this much text
MAX_STOPS = 16


def stop_list(value: str | list[str] | None) -> list[str]:
    """A request's stop strings as a list; ValueError past the count or length the matcher takes."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise ValueError(f"stop sequences are at most {MAX_STOP_LENGTH} characters long")
    return stops


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(StructuredOutputFields, NullMeansDefault):
    # Unknown fields (user, service_tier, ...) are accepted and ignored, as OpenAI-compatible servers do.
    # Every number is range-checked here, at the edge: NaN and infinities are refused outright.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None  # the served model when left out (a server of one model)
    # Beyond the room the prompt leaves, a cap (the answer ends with "length"); int32, as llama-server.
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)  # k at or above the vocabulary keeps every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    # Any integer, as llama-server takes it (OpenAI documents signed 64-bit; clients send -1 or 2**64 - 1
    # alike): the sampler reduces it mod 2**64 into MLX's key range. JSON integers are bounded in length.
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: bool = True  # false: this request never speculates (when the server does)
    # vLLM's: more tokens that end the answer, a floor under the answer's length (end-of-sequence and
    # stop_token_ids are held off until then), and the stop string reached kept at the end of the text.
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    # Output kinds only text is: refused rather than answered in text alone.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value and any(m != "text" for m in value):
            raise ValueError("only text output is supported")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("audio output is not supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100.0 <= v <= 100.0 for v in value.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        stop_list(value)
        return value

    def prompt_logprobs_count(self) -> int | None:
        """How many top log-probabilities each prompt token gets (None: the prompt is not scored)."""
        return None

    @property
    def scores_only(self) -> bool:
        """Whether the prompt is only scored, nothing generated."""
        return False

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias or {}),
            # n choices from one seed must differ, and stay reproducible.
            seed=None if self.seed is None else self.seed + choice,
            stop=stop_list(self.stop),
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            speculative=self.speculative,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs_count(),
            constraint=self.constraint(),
        )


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # OpenAI's is a JSON string; some clients send the object


class ToolCallParam(BaseModel):
    """A call an assistant message made, as OpenAI's clients send it back."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallParam] | None = None

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        # As OpenAI: only an assistant turn (with tool calls) may leave out its content, and a tool
        # result names the call it answers.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not isinstance(getattr(self, "tool_call_id", None), str):
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @field_validator("content")
    @classmethod
    def _text_parts(
        cls, value: str | list[dict[str, Any]] | None, info: ValidationInfo
    ) -> str | list[dict[str, Any]] | None:
        # Text parts only (an assistant's may be a refusal); images, audio and files are not supported.
        kinds = ("text", "refusal") if info.data.get("role") == "assistant" else ("text",)
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type")
            key = "refusal" if kind == "refusal" else "text"
            if kind not in kinds:
                raise ValueError(f"content.{i}: {kind!r} parts are not supported, only text parts")
            if not isinstance(part.get(key), str):
                raise ValueError(f"content.{i}: a {kind} part needs its {key} as a string")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [part.get("text", part.get("refusal")) for part in self.content]
            # A line each, as vLLM joins them; an assistant's parts are pieces of one answer.
            return ("" if self.role == "assistant" else "\n").join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}} (checked when used)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": false}
    # A conversation longer than the context: drop whole turns or fail (None: the server's default).
    context_overflow: Policy | None = None
    # vLLM's: keep the prompt within this many tokens (-1: the context), here by dropping whole turns.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's: open the assistant's turn after the messages (the default), or continue the final
    # assistant message from its last character (the two exclude each other).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's deprecated forms of tools and tool_choice: refused with the way to say it now, rather
    # than answered as if no function had been offered.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools_not_functions(self) -> ChatCompletionRequest:
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, old) is not None:
                raise InvalidRequest(
                    f"{old} is deprecated and not supported: send {new} (OpenAI's current form)", param=old
                )
        return self

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatCompletionRequest:
        """As OpenAI's: a tool message answers a call of the assistant message before it (tool messages
        between), and each of that message's calls is answered before the conversation goes on or ends."""
        offered: set[str] = set()
        pending: set[str] = set()
        for i, message in enumerate([*self.messages, None]):  # None: the end of the conversation
            if message is not None and message.role == "tool":
                call_id = getattr(message, "tool_call_id", None)
                if call_id not in offered:
                    raise InvalidRequest(
                        f"messages.{i}: a tool message answers a tool call of the assistant message before "
                        f"it, and none has the id {call_id!r}",
                        param=f"messages.{i}.tool_call_id",
                    )
                pending.discard(call_id)
                continue
            if pending:
                where = f"messages.{i}" if message is not None else "messages"
                raise InvalidRequest(
                    f"{where}: an assistant message with tool_calls must be followed by tool messages "
                    f"answering each call; none answers {', '.join(sorted(pending))}",
                    param=where,
                )
            calls = message.tool_calls if message and message.role == "assistant" else None
            offered = {call.id for call in calls or []}
            pending = set(offered)
        return self

    @model_validator(mode="after")
    def _one_way_to_answer(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt: false", param="continue_final_message"
            )
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_nonzero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_PROMPTS = 64  # prompts of one completions request (each gets n choices)


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a batch of them, as OpenAI's and vLLM's completions take.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # What OpenAI's legacy completions also take and this server does not do: refused, not ignored.
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported (fill in the middle)")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("not supported (n choices are returned, each sampled alone)")
        return value

    # 0 with echo scores the prompt without generating (echo with logprobs: each prompt token's
    # log-probability, as lm-evaluation-harness asks), as OpenAI's and vLLM's completions allow.
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            # Not a ValueError, which pydantic would report with no field: this one names it.
            raise InvalidRequest(
                "max_tokens 0 needs echo: true (nothing would be returned)", param="max_tokens"
            )
        return self

    @property
    def scores_only(self) -> bool:
        """Echo of the prompt alone, nothing generated (``max_tokens`` 0)."""
        return self.echo and self.max_tokens == 0

    @field_validator("prompt")
    @classmethod
    def _batch(cls, value: str | list) -> str | list:
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts a request")
            if any(len(p) == 0 for p in value):
                raise ValueError("a prompt of the batch is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or each of a batch."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if batch else [self.prompt]  # type: ignore[list-item]

    def max_new_tokens(self) -> int | None:
        # The legacy completions API defaults to 16 new tokens. Scoring alone still runs one step (the
        # engine always samples the token after the prompt); that token is not returned.
        return max(1, self.max_tokens) if self.max_tokens is not None else 16

    def prompt_logprobs_count(self) -> int | None:
        """Log-probabilities of the echoed prompt's tokens are asked for by echo with logprobs."""
        return self.logprobs if self.echo else None

    def logprobs_count(self) -> int | None:
        return self.logprobs
