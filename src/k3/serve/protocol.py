"""The OpenAI-compatible API's request and response bodies as pydantic models: what the routes validate and what
/openapi.json documents. Requests are strict (no string-to-number coercion) and an unknown field is a 400 naming it,
so an option k3 would otherwise drop is never a silent 200. Responses are built as plain dicts on the hot path;
their models here document them (and the tests validate live responses against them)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from k3.serve import sampling

MAX_N = 32                 # choices per prompt (`n`)
MAX_PROMPTS = 1024         # prompts in one batched /v1/completions request
MAX_CHOICES = 1024         # prompts × n: sequences one request may start
MAX_SEED = sampling.MAX_SEED  # seeds lie in [0, MAX_SEED)
MAX_LOGPROBS = sampling.MAX_LOGPROBS
MAX_STOP_STRINGS = sampling.MAX_STOP_STRINGS
MAX_STOP_TOKEN_IDS = sampling.MAX_STOP_TOKEN_IDS
MAX_LOGIT_BIAS = sampling.MAX_LOGIT_BIAS
MAX_CHECKPOINTS = 1024     # k3's checkpoint_at positions


TokenId = Annotated[int, Field(ge=0)]  # the vocabulary's upper bound is the served model's: checked per request


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(Strict):
    """The fields completions and chat share: sampling, stopping, streaming and k3's extensions."""
    model: str
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (0: score the prompt only)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = Field(None, description=f"at most {MAX_STOP_STRINGS} strings")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=sampling.REPETITION_PENALTY_RANGE[0],
                                      le=sampling.REPETITION_PENALTY_RANGE[1], description="vLLM's: 1 is off")
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None  # an end-user label with no effect on the output
    policy_version: Union[int, str, None] = None  # k3: prefix-cache namespace (RL weight version)
    return_token_ids: bool = False  # k3: generated ids per choice / per streamed chunk, prompt ids per choice


Prompt = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description=f"a string, token ids, or a list of up to {MAX_PROMPTS} of either")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="OpenAI's bound is 5, vLLM's 20")
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: top-k per prompt token")
    best_of: int | None = Field(None, description="only 1 (or n): k3 does not rank candidates")
    suffix: str | None = Field(None, description="not supported (a 400 when given)")
    checkpoint_at: list[int] | None = Field(None, max_length=MAX_CHECKPOINTS,
                                            description="k3: prompt positions worth a KDA checkpoint")


class ChatTemplateKwargs(Strict):
    """vLLM's `chat_template_kwargs`: the options of K3's chat template (an unknown one is a 400)."""
    thinking: bool = True
    thinking_effort: str | None = None


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | None = None  # OpenAI's: low, medium, high (and k3's max); none turns thinking off
    metadata: dict[str, str] | None = None  # accepted: no effect on the output


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # what lm-eval's remote tokenizer sends; k3 adds none either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CacheInfo(BaseModel):
    """k3: what the prefix cache did for the (first) request."""
    matched_tokens: int
    restored_tokens: int
    reason: str


class CompletionHead(BaseModel):
    """What every completion and chat body and stream chunk carries besides its object and choices."""
    id: str
    created: int
    model: str
    usage: Usage | None = None
    k3_cache: CacheInfo | None = None


class CompletionLogprobs(BaseModel):
    """One entry per returned token; with echo, the prompt's tokens first (the very first has no logprob)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(CompletionHead):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatResponse(CompletionHead):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatStreamChunk(CompletionHead):
    """One `data:` event of a streamed chat completion (the last, with stream_options.include_usage, has usage
    and no choices); a stream that fails mid-way sends `data: {"error": {...}}` and closes."""
    object: Literal["chat.completion.chunk"]
    choices: list[ChatStreamChoice]


class CompletionStreamChunk(CompletionHead):
    """One `data:` event of a streamed completion (see ChatStreamChunk)."""
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What vLLM's /tokenizer_info gives and lm-eval's remote tokenizer reads (special tokens, chat template)."""
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class Health(BaseModel):
    status: str


class Version(BaseModel):
    version: str

