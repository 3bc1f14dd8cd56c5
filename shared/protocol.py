# Over 400 lines: every message of the services' wire contract in one place, read whole by each service and by docs/API.md.
"""Every message radixserve services exchange over NATS, as msgspec Structs (msgpack on the wire).

Subjects (prefix `rs` by default, configurable so deployments can share one NATS):
  {p}.tokenize                   gateway -> tokenizer (queue group "tokenizer"): TokenizeRequest
  {p}.worker.{wid}.requests      tokenizer -> worker: GenerateRequest
  {p}.worker.{wid}.control       gateway -> worker, request/reply: ControlRequest -> ControlReply
  {p}.detok.{wid}                worker -> detokenizer, at most one per scheduler step: BatchTokenOut
  {p}.gateway.{gid}.stream       detokenizer/tokenizer -> gateway, one per step per gateway:
                                 BatchStreamOut (text deltas, finals, errors)
  {p}.workers.load               worker -> gateways, every second: WorkerLoad
  {p}.v1.generate                NATS clients -> gateway (queue group "gateway"), request with a reply
                                 inbox: NatsGenerateRequest; replies NatsGenerateChunk ... final=True
  {p}.v1.abort                   NATS clients -> every gateway (no queue group): NatsAbort
  {p}.gateway.abort              gateway -> every gateway: GatewayAbort (a user key's abort of an rid
                                 the sending gateway does not hold)
Every message carries `v` (PROTOCOL_VERSION); a receiver drops (and logs) a message of another version
or one that does not decode. Hot-path messages are batched per scheduler step: token streaming costs
O(steps) messages, not O(tokens); a request that is not streamed (TokenizeRequest.stream) costs two
items, its first token and its final.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import msgspec

from shared.sampling_params import check_request

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "rs"


class Subjects:
    """Subject names for one deployment prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.tokenize = f"{prefix}.tokenize"
        self.tokenize_text = f"{prefix}.tokenize.text"
        self.workers_load = f"{prefix}.workers.load"
        self.v1_generate = f"{prefix}.v1.generate"
        self.v1_abort = f"{prefix}.v1.abort"
        self.gateway_abort = f"{prefix}.gateway.abort"

    def worker_requests(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.requests"

    def worker_control(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.control"

    def detok(self, worker_id: str) -> str:
        return f"{self.prefix}.detok.{worker_id}"

    def gateway_stream(self, gateway_id: str) -> str:
        return f"{self.prefix}.gateway.{gateway_id}.stream"


# ---- shared pieces ------------------------------------------------------------------------------


class Sampling(msgspec.Struct, omit_defaults=True):
    """A request's sampling settings as sent; None means "unset" (model defaults apply). Same names
    and meanings as shared.sampling_params.SamplingParams.

    The one declaration of the request's sampling fields: the HTTP forms (native and OpenAI), the gRPC
    mapping and the .proto are derived from or checked against it (tests/test_request_contract.py)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    # Constrained decoding, at most one: a JSON schema (as JSON text), a regex, an EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def to_dict(self) -> dict[str, object]:
        """Only the fields that were set (for SamplingParams.from_dict)."""
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}

    def validate(self) -> None:
        """ValueError naming the field for any value no worker could carry or honour (the edge's check;
        the worker adds its vocabulary, context and pool)."""
        check_request(self.to_dict())


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str
    # An assistant turn's tool calls (OpenAI's shape: id, type, function {name, arguments}) and a tool
    # turn's answer to one, for chat templates that render them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class Finish(msgspec.Struct, omit_defaults=True):
    """Why a request ended: type 'stop' | 'length' | 'abort' | 'error'; matched token id or string.
    `status`, on an 'error' final: the HTTP status every door answers it with (None: 400, the
    request's own fault; 5xx: the server could not serve it, e.g. 503 for a worker shutting down).
    `param`, on an 'error' final: the request field at fault, when one is (a prompt's: `text`,
    `messages` or `input_ids`, which a gateway renames to the field its client sent)."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    status: int | None = None
    param: str | None = None


class Usage(msgspec.Struct, omit_defaults=True):
    """A request's token counts, made once by its worker and passed along whole on its final (TokenOut
    -> StreamOut -> the gateway's reply): prompt tokens, generated tokens, prompt tokens served from the
    prefix cache; with speculative decoding, mean tokens per verify step and the share of proposed
    tokens accepted."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PromptLogprobs(msgspec.Struct, omit_defaults=True):
    """A prompt's log-probs (a request's `logprob_start_len` k, SGLang's input_token_logprobs): prompt
    tokens k .. n-1, each with log P(token | the tokens before it); the first has none (None), as its
    top list. Sent once, at the end of the prefill; texts added by the detokenizer as for Logprobs."""

    token_ids: list[int]
    values: list[float | None]
    top: list[list[TopLogprob] | None] | None = None
    texts: list[str] | None = None
    top_texts: list[list[str] | None] | None = None
    text: str | None = None  # the tokens decoded together (the detokenizer's): a token-id prompt's echo


class Logprobs(msgspec.Struct, omit_defaults=True):
    """The log-probs of the output tokens beside it (one per token id), made once by the worker and passed
    along whole; `top`: each token's most likely candidates, when the request asked for them. The
    detokenizer adds each token's own text and each candidate's (`texts`, `top_texts`): OpenAI's
    logprobs name tokens by text, and only it has the tokenizer. Without them the gateway names a token
    "token_id:<id>"."""

    values: list[float]
    top: list[list[TopLogprob]] | None = None
    texts: list[str] | None = None
    top_texts: list[list[str]] | None = None
    prompt: PromptLogprobs | None = None  # on the item that ends the prefill, when the request asked


# ---- gateway -> tokenizer -> worker -------------------------------------------------------------


class TokenizeRequest(msgspec.Struct, tag="tokenize", omit_defaults=True):
    """One request to tokenize: exactly one of text, messages (chat) or input_ids."""

    v: int
    rid: str
    gateway_id: str
    worker_id: str
    sampling: Sampling
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    add_generation_prompt: bool = True
    # Extra variables for the chat template (vLLM's and SGLang's chat_template_kwargs), e.g. Qwen3's
    # {"enable_thinking": false}; messages only.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the chat template
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the first prompt position listed with the prompt's log-probs (SGLang's
    # logprob_start_len; None: no prompt log-probs). A migrated request (resume_ids) drops it.
    logprob_start_len: int | None = None
    priority: int = 0
    # False: the client wants the whole answer only, so the worker sends the first token and the final
    # (with every other token), not every step.
    stream: bool = True
    # Migration from a lost worker: the tokens its client has already received, which the new worker
    # treats as generated (they count against max_new_tokens, penalties and stop checks), and how many
    # characters of their text the client has already seen (the detokenizer continues from there).
    resume_ids: list[int] | None = None
    resume_chars: int = 0


class TextTokenize(msgspec.Struct, tag="text_tokenize", omit_defaults=True):
    """A question for the tokenizer itself, request/reply on {p}.tokenize.text (the gateway's /tokenize
    and /detokenize): the ids of `text` or of chat `messages`, or the text of `input_ids`."""

    v: int
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None  # to detokenize
    add_special_tokens: bool = True  # text: as the tokenizer's encode; messages: the template holds them
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TextTokenized(msgspec.Struct, tag="text_tokenized", omit_defaults=True):
    """The answer: ids (tokenized) or text (detokenized), the model's context length; or an error."""

    v: int
    input_ids: list[int] | None = None
    text: str | None = None
    context_len: int = 0
    error: str | None = None


class GenerateRequest(msgspec.Struct, tag="generate", omit_defaults=True):
    """A tokenized request for one worker."""

    v: int
    rid: str
    gateway_id: str
    input_ids: list[int]
    sampling: Sampling
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the first prompt position listed with the prompt's log-probs (SGLang's
    # logprob_start_len; None: no prompt log-probs). A migrated request (resume_ids) drops it.
    logprob_start_len: int | None = None
    priority: int = 0
    stream: bool = True  # as on TokenizeRequest
    resume_ids: list[int] | None = None  # as on TokenizeRequest
    resume_chars: int = 0


# ---- worker -> detokenizer -> gateway -----------------------------------------------------------


class TokenOut(msgspec.Struct, omit_defaults=True):
    """What one request produced since its last TokenOut: one step's tokens, or several steps' (a
    request that is not streamed, or steps that queued at the worker). `stop`/`skip_special_tokens`
    ride on the request's first TokenOut so the detokenizer needs no other channel."""

    rid: str
    gateway_id: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish: Finish | None = None
    usage: Usage | None = None  # on the final
    first: bool = False
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    # On the first item of a migrated request: the tokens (and characters of text) its client already
    # has, so the detokenizer continues the text instead of starting it again.
    resume_ids: list[int] | None = None
    resume_chars: int = 0


class BatchTokenOut(msgspec.Struct, tag="batch_token_out"):
    """The requests a worker advanced in one scheduler step (or in the steps that queued while its
    previous message went out; `step` is the last one's number)."""

    v: int
    worker_id: str
    step: int
    items: list[TokenOut]


class StreamOut(msgspec.Struct, omit_defaults=True):
    """One request's text delta for one step (empty text when a token completed no character)."""

    rid: str
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None  # as the worker made it, with the tokens' texts added
    finish: Finish | None = None
    usage: Usage | None = None  # on the final, as the worker made it


class BatchStreamOut(msgspec.Struct, tag="batch_stream_out"):
    """Every request of one gateway advanced in one step (or one error from the tokenizer)."""

    v: int
    items: list[StreamOut]


# ---- control and load ---------------------------------------------------------------------------


class ControlRequest(msgspec.Struct, tag="control", omit_defaults=True):
    """command: 'abort' (rid required), 'flush_cache', 'get_info', 'ping' (answered by the worker's
    event loop at once, without the scheduler: the reply's message is the worker's instance id) or
    'status' (rid required: ok when the worker holds that request)."""

    v: int
    command: str
    rid: str | None = None


class WorkerInfo(msgspec.Struct):
    worker_id: str
    model: str
    max_total_tokens: int
    max_running_requests: int
    context_len: int
    num_running: int
    num_waiting: int
    kv_free: int
    kv_cached: int
    kv_in_use: int
    cache_hit_rate: float
    generated_tokens: int
    tp_size: int
    device: str
    pp_size: int = 1  # pipeline stages, each a TP group of tp_size ranks
    nnodes: int = 1  # hosts the worker's ranks span (node 0 is this worker)


class ControlReply(msgspec.Struct, tag="control_reply", omit_defaults=True):
    v: int
    ok: bool
    message: str | None = None
    info: WorkerInfo | None = None


class WorkerLoad(msgspec.Struct, tag="worker_load"):
    """Published every `interval` seconds by each worker's event loop, never waiting for its scheduler
    (the figures are the latest the scheduler gave). Gateways route on it; a worker silent for a while
    is probed on its control subject, and only a worker whose subscription is gone (process or
    connection dead) loses its requests (services/gateway/liveness.py). `instance` changes when the
    worker process restarts under the same id; `steps` counts the scheduler steps it has published, so
    a gateway can tell a worker that is making progress from one that is not."""

    v: int
    worker_id: str
    model: str
    num_running: int
    num_waiting: int
    kv_usage: float
    cache_hit_rate: float
    max_total_tokens: int
    context_len: int
    timestamp: float
    instance: str = ""
    steps: int = 0
    interval: float = 1.0
    draining: bool = False  # sent once on SIGTERM: route nothing new here, its requests still finish


# ---- the NATS front door ------------------------------------------------------------------------


class NatsGenerateRequest(msgspec.Struct, tag="nats_generate", omit_defaults=True):
    """A client's request on {p}.v1.generate: one of text, messages or input_ids."""

    v: int
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    model: str | None = None
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the prompt's log-probs from this position on (SGLang's; None or -1: none).
    logprob_start_len: int | None = None
    stream: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: extra chat template variables
    timeout: float | None = None  # seconds the request may take; past it, it is aborted (error 504)


class NatsGenerateChunk(msgspec.Struct, tag="nats_chunk", omit_defaults=True):
    """A reply: text delta(s); the last one has final=True with finish and usage, or an error. The usage
    fields are Usage's, flat (the NATS client API as docs/API.md states it): `usage_fields` fills them."""

    v: int
    rid: str
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = None
    # With logprob_start_len k, once (on the chunk that ends the prefill; not streamed: the final): prompt
    # tokens k .. n-1 and their log-probs, the first None.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    final: bool = False
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_accept_length: float | None = None  # as on StreamOut, on a final with speculative decoding
    spec_accept_rate: float | None = None
    error: str | None = None
    retry_after: int | None = None  # on a "429: ..." error: seconds until the API key's limit admits again


def usage_fields(usage: Usage | None) -> dict[str, Any]:
    """A Usage as NatsGenerateChunk's flat keyword arguments."""
    return msgspec.structs.asdict(usage) if usage is not None else {}


class NatsAbort(msgspec.Struct, tag="nats_abort"):
    """Sent by a client to {p}.v1.abort to stop its request."""

    v: int
    rid: str


class GatewayAbort(msgspec.Struct, tag="gateway_abort"):
    """A user key's abort of `rid`, passed on by the gateway that got it (`gateway_id`) to the others:
    the one holding the request aborts it if `key_id` (the key's hash) made it."""

    v: int
    rid: str
    key_id: str
    gateway_id: str


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(*types: type) -> msgspec.msgpack.Decoder:
    """A msgpack decoder for one message type or a tagged union of several."""
    return msgspec.msgpack.Decoder(functools.reduce(operator.or_, types))
