"""Messages of memstep's two sockets: the client API and the core <-> executor link.

Every class is a registered record, so the shared codec (`events/codec.py`) encodes and decodes
it as a msgpack map ``{"t": ClassName, field: value, ...}``; nothing is pickled.  The API is
documented for other languages in `docs/protocol.md`.

Client requests are decoded by `decode_request`, which is more forgiving than the codec in one
way only: a field with a default may be left out.  Everything else is checked strictly, and
each problem raises `WireError` with the code that goes back to the client.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgpack

from memstep.events import codec
from memstep.events.types import MemoryReport, record, row_record

# 2 since GenerateDelta and GenerateDone carry prompt_logprobs (a delta's row is one wider); 3
# since each prompt token's entry there ends with its rank
PROTOCOL_VERSION = 3
MAX_REQUEST_ID_CHARS = 128

# --- client -> server ----------------------------------------------------------------------


@record
class GenerateRequest:
    """Start a completion.  Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str  # chosen by the client, unique among its requests in flight
    prompt: str | None = None  # raw text, no chat template
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # [{"role": ..., "content": ...}], templated
    params: dict = attrs.Factory(dict)  # SamplingParams fields; absent ones take defaults
    stream: bool = False
    special_tokens_in_messages: bool = False  # read "<|im_start|>" in a message as the token
    # a request migrated off a dead engine (router/): the tokens its client already has; they are
    # taken as the first outputs and sampling goes on after them (needs params["seed"])
    output_token_ids: list[int] = attrs.Factory(list)
    # a streaming request's GenerateDelta may come inside a GenerateDeltas: one frame a step for
    # all such requests of the client, instead of one per request (the HTTP front asks for it)
    batch_deltas: bool = False
    # variables for the chat template beside `messages` (vLLM's, e.g. {"enable_thinking": false})
    chat_template_kwargs: dict = attrs.Factory(dict)
    # the tokenizer's own special tokens (a BOS, say) added around a text prompt's or a chat's
    # ids, as Hugging Face's and vLLM's add_special_tokens=True; token ids are taken as given
    add_special_tokens: bool = False


@record
class AbortRequest:
    request_id: str  # this message's own id
    target_id: str  # the generate request to abort


@record
class HealthRequest:
    request_id: str


@record
class StatsRequest:
    request_id: str


@record
class TokenizeRequest:
    """The token ids the engine reads a prompt as (raw `prompt`, or chat `messages` in the chat
    template with the assistant's turn begun, as a GenerateRequest reads them), or the text of
    `token_ids` (detokenize).  Exactly one of the three is set, or none with `tokenizer_info`."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    special_tokens_in_messages: bool = False
    chat_template_kwargs: dict = attrs.Factory(dict)  # as the GenerateRequest's
    tokenizer_info: bool = False  # instead: the tokenizer's config (TokenizeReply.config)
    add_special_tokens: bool = False  # as the GenerateRequest's


@record
class AttachRequest:
    """Receive the rest of a generate request that an earlier server was answering when it died,
    from a server resumed from its log (`serve --resume`); replies as to a GenerateRequest."""

    request_id: str  # the id the client gave that generate request
    from_index: int = 0  # the first output token to send: how many the client already has
    stream: bool = True


API_REQUESTS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        AbortRequest,
        HealthRequest,
        StatsRequest,
        AttachRequest,
        TokenizeRequest,
    )
}

# --- server -> client ----------------------------------------------------------------------


@row_record
class GenerateDelta:
    """New tokens of a streaming request, one message per engine step that produced some."""

    request_id: str
    token_ids: list[int]
    text: str
    # per token when params.logprobs = N > 0: [id, text, logprob, [[id, text, logprob] x N]]
    logprobs: list[list] = attrs.Factory(list)
    # params.prompt_logprobs = N: every prompt token as logprobs' entries and its rank (1 + the
    # tokens scored above it), [id, text, logprob, [[id, text, logprob] x N], rank]; the first
    # one's logprob and rank None, with no alternatives: nothing comes before it. On the first
    # delta
    prompt_logprobs: list[list] = attrs.Factory(list)


@record
class GenerateDeltas:
    """One step's GenerateDelta of every streaming request of one client that asked for them
    together (`GenerateRequest.batch_deltas`), in one frame: a server with hundreds of streams
    to one HTTP front sends, and the front reads, one frame a step instead of hundreds.  Each
    delta travels as a row (an array of its field values, in order)."""

    deltas: list[GenerateDelta]


@record
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held


@record
class Timing:
    """Seconds since the server received the request."""

    ttft_s: float | None  # first token; None when none was produced
    token_times_s: list[float]  # each output token, in order
    e2e_s: float  # the finishing reply
    queue_s: float | None = None  # first scheduled into a step; None when never scheduled


@record
class GenerateDone:
    """The last reply of a generate request, streaming or not: the whole completion."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage
    timing: Timing
    logprobs: list[list] = attrs.Factory(list)  # per token, as in GenerateDelta
    prompt_logprobs: list[list] = attrs.Factory(list)  # the prompt's, as GenerateDelta's


@record
class AbortReply:
    request_id: str
    target_id: str


@record
class HealthReply:
    request_id: str
    status: str  # "ok" | "recovering" (a new executor is starting) | "dead" (gave up)
    executor_alive: bool
    executor_pid: int  # 0 when the executor runs inside the core
    core_pid: int
    model: str
    max_model_len: int
    vocab_size: int
    max_frame_bytes: int  # larger frames get a frame_too_large error
    uptime_s: float
    memstep_version: str
    protocol: int
    detail: str  # why the engine is dead, or that it is recovering, else ""


@record
class StatsReply:
    request_id: str
    num_running: int
    num_waiting: int
    num_inflight: int  # requests the server is answering (all clients)
    num_clients: int  # clients with requests in flight
    step: int
    step_kind: str  # the engine's current phase or serving kind
    kv_pages_total: int
    kv_pages_used: int  # held by requests
    memory: MemoryReport | None  # from the last StepFinished; None before the first step
    finished: dict[str, int]  # finished requests by reason, incl. "disconnect", "executor_dead"
    kv_pages_cached: int = 0  # held by none, caching prefix blocks (reclaimable)
    prompt_tokens: int = 0  # totals since the server started
    generation_tokens: int = 0
    num_preemptions: int = 0  # by the scheduler, for room
    num_requeues: int = 0  # by executor losses
    num_leak_reports: int = 0
    steps: dict[str, int] = attrs.Factory(dict)  # steps run, by kind
    transitions: dict[str, int] = attrs.Factory(dict)  # "old->new" kind changes
    host_rss_bytes: dict[str, int] = attrs.Factory(dict)  # "core", "executor": resident bytes
    refused: dict[str, int] = attrs.Factory(dict)  # generate requests refused, by error code
    # a router's reply (router/): each replica's figures by name ("live", "num_running", ...)
    replicas: dict[str, dict[str, int]] = attrs.Factory(dict)


# the error codes a well-formed generate request is refused with for now, not for what it is
# (docs/protocol.md §6 lists every code): retry later; over HTTP each is a 503 with Retry-After
OVERLOADED = "overloaded"  # --max-waiting-requests others already wait for the running batch
RECOVERING = "recovering"  # a new executor starts and --max-new-while-recovering new ones wait
EXECUTOR_DEAD = "executor_dead"


@record
class TokenizeReply:
    request_id: str
    token_ids: list[int]  # the prompt's, or the token_ids given
    text: str  # the token ids' text (the prompt as given, for a raw prompt)
    max_model_len: int  # prompt + output tokens at most
    # with `tokenizer_info`: tokenizer_config.json's special tokens and chat template (vLLM's)
    config: dict = attrs.Factory(dict)


@record
class ErrorReply:
    request_id: str  # "" when the frame was too broken to carry one
    code: str  # e.g. OVERLOADED
    message: str


@record
class Keepalive:
    """Sent about once a second to a client with requests in flight that heard nothing else.

    It probes the connection (a closed one fails the send and aborts the client's requests) and
    tells the client the server is alive.  Clients ignore it.
    """

    request_ids: list[str]


# --- core <-> executor ---------------------------------------------------------------------


@record
class ExecutorHello:
    """The executor's first message, sent as soon as it has connected."""

    pid: int
    memstep_version: str
    protocol: int


@record
class ExecutorInit:
    config: dict  # EngineConfig.to_dict()
    max_model_len: int


@record
class ExecutorReady:
    """The model is loaded; the executor takes PhaseRequest and StepPlan from now on."""

    pid: int
    device: str


@record
class ExecutorStop:
    reason: str


@record
class ExecutorError:
    """The executor could not do what it was asked; it keeps running."""

    code: str  # "bad_message" | "exception"
    message: str


@record
class Heartbeat:
    sender: str  # "core" | "executor"
    seq: int
    sent_at: float  # sender's time.time()


# --- decoding client requests --------------------------------------------------------------


class WireError(ValueError):
    """A client frame that cannot be served; `code` and the message go back in an ErrorReply."""

    def __init__(self, code: str, message: str, request_id: str = ""):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def peek_request_id(frame: bytes) -> str:
    """The `request_id` of a record map too large to decode whole, read key by key (skipping
    the values of other keys), so that its error reaches the request; "" when there is none."""
    unpacker = msgpack.Unpacker(max_buffer_size=len(frame), raw=False)
    unpacker.feed(frame)
    try:
        for _ in range(min(unpacker.read_map_header(), 16)):
            if unpacker.unpack() == "request_id":
                rid = unpacker.unpack()
                return rid if type(rid) is str and len(rid) <= MAX_REQUEST_ID_CHARS else ""
            unpacker.skip()
    except Exception:  # anything malformed: no id to be had
        return ""
    return ""


def decode_request(frame: bytes, max_bytes: int) -> Any:
    """Decode one client frame into an API request record, or raise WireError."""
    if not frame:
        raise WireError("malformed_frame", "empty frame")
    if len(frame) > max_bytes:
        message = f"frame of {len(frame)} bytes > limit {max_bytes}"
        raise WireError("frame_too_large", message, peek_request_id(frame))
    try:
        obj = codec.unpack(frame)
    except codec.CodecError as exc:
        raise WireError("malformed_frame", f"not a msgpack message: {exc}") from exc
    if type(obj) is not dict:
        raise WireError("malformed_frame", f"expected a msgpack map, got {type(obj).__name__}")
    rid = obj.get("request_id")
    rid = rid if type(rid) is str and len(rid) <= MAX_REQUEST_ID_CHARS else ""
    name = obj.get("t")
    cls = API_REQUESTS.get(name) if type(name) is str else None
    if cls is None:
        known = ", ".join(API_REQUESTS)
        raise WireError(
            "unknown_type", f"unknown message type {codec.describe(name)}; use {known}", rid
        )
    return _from_map(cls, obj, rid)


def _from_map(cls: type, obj: dict, rid: str) -> Any:
    full = dict(obj)
    names = {field.name for field in attrs.fields(cls)}
    for field in attrs.fields(cls):
        if field.name in full:
            continue
        if field.default is attrs.NOTHING:
            raise WireError("missing_field", f"{cls.__name__}: missing field {field.name!r}", rid)
        default = field.default
        is_factory = isinstance(default, attrs.Factory)  # type: ignore[arg-type]
        full[field.name] = default.factory() if is_factory else default
    extra = [key for key in full if key != "t" and key not in names]
    if extra:
        raise WireError(
            "unknown_field", f"{cls.__name__}: unknown field {codec.describe(extra[0])}", rid
        )
    try:
        msg = codec.from_obj(full)
    except codec.CodecError as exc:
        raise WireError("invalid_field", str(exc), rid) from exc
    if not 1 <= len(msg.request_id) <= MAX_REQUEST_ID_CHARS:
        raise WireError(
            "invalid_field", f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters", rid
        )
    return msg
