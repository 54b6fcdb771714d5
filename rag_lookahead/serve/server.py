"""OpenAI-compatible HTTP server with continuous batching over the lossless lookahead loop.

    rag_lookahead serve --port 8000 --index-dir ~/my_index
    curl -N 127.0.0.1:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"hi"}],"stream":true}'

One engine thread owns the model and the running :class:`rag_lookahead.decoding.loop.DecodeBatch`
(one per output pool, see ``--output-pool``). HTTP handlers (asyncio, uvicorn) validate a request,
tokenize it in a worker thread, put it into a bounded waiting queue (full -> 429) and read the
request's events from an ``asyncio.Queue`` that the engine feeds with ``loop.call_soon_threadsafe``.
Between decode steps the engine

1. retires finished rows (EOS, max_tokens, a stop string seen, the client gone) at once,
2. admits waiting requests up to the batch size (one prefill per output pool, merged into the
   running batch),
3. runs one propose -> verify -> accept step for every batch and pushes each row's new text.

Failures are contained: a prefill that fails fails the requests it admitted (retried one by one
to find the one at fault), a failed step or retire fails the batch it ran on, a failure while
turning one row's tokens into text fails that request only; the engine thread carries on. If the
thread itself dies, every waiting client gets an error at once and ``/health`` says so. Clients
get a short message with an error id; the details go to the log.

Decoding is lossless: a request's text is what a single-request ``generate`` gives for the same
prompt (greedy when ``temperature`` is 0 or absent; a sample of the model's own distribution
otherwise, the same text for the same ``seed`` whatever else is in the batch), in fp32 with TF32
off; in bf16/fp16 kernels change with the batch shape and near-ties can flip. ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``n`` (choice i draws with ``seed + i``) are
honoured; options we do not implement are refused with 400, never ignored.

Endpoints: ``POST /v1/completions`` (raw prompt, no chat template; a string or a list of token
ids), ``POST /v1/chat/completions`` (messages through the tokenizer's chat template), both with
``stream`` (server-sent events in OpenAI's chunk shapes, ``data: [DONE]``); ``POST /v1/rag``
(retrieve from the loaded index, seed the trie with the passages left out of the prompt);
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Security: loopback bind by default; requests whose ``Host`` (or browser ``Origin``) is not the
bound host, a loopback name or an ``--allowed-hosts`` entry are refused (DNS rebinding); no CORS
headers are ever sent; with ``--api-key`` every endpoint but ``/health`` needs
``Authorization: Bearer KEY``. Limits (body size, messages, stop strings, prompt and answer
length, queue) are :class:`ServerConfig` fields with flags of the same names.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' string annotations here
from starlette.responses import StreamingResponse

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, InputError

__all__ = ["ServerConfig", "SamplingRequest", "Engine", "ApiError", "create_app", "make_server", "main"]

log = logging.getLogger("rag_lookahead.serve.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
API_KEY_ENV = "RAG_LOOKAHEAD_API_KEY"
OUTPUT_POOL_MODES = ("shared", "per-key", "off")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MiB = 1 << 20

#: Seconds uvicorn waits for connections to close after the drain (slow readers, idle keep-alives).
CLOSE_GRACE_SECONDS = 5.0
#: How long a handler waits for its next event before it looks whether the engine thread died.
POLL_SECONDS = 0.25
#: How often a handler looks whether its client left, events flowing or not.
CLIENT_CHECK_SECONDS = 0.25


# ---------------------------------------------------------------- configuration


#: (low, high) of every integer setting; the upper bounds keep a typo from allocating the machine away.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "port": (0, 65535),
    "max_batch_size": (1, 1024),
    "max_queue": (1, 1_000_000),
    "max_prompt_tokens": (1, 10_000_000),
    "max_tokens_limit": (1, 10_000_000),
    "default_max_tokens": (1, 10_000_000),
    "k_prompt": (1, 32),
    "k_seed": (1, 256),
    "max_stop": (1, 256),
    "max_stop_chars": (1, 4096),
    "max_messages": (1, 100_000),
    "max_body_bytes": (1024, 1 << 30),
}


@dataclass
class ServerConfig:
    """Every knob of the server; the ``serve`` flags mirror these names (``--max-body-bytes`` ...).

    host/port: where to listen (loopback by default).
    model: "default", a hub id or a local folder (see :func:`rag_lookahead.models.load_model`).
    served_model_name: the name reported in responses when the request names none.
    index_dir: document index for ``/v1/rag`` (None: the default index if it exists).
    max_batch_size: most rows decoded together.
    max_queue: most requests waiting for a batch slot; more are refused with 429.
    max_prompt_tokens: longest prompt accepted (400 beyond).
    max_tokens_limit: largest ``max_tokens`` accepted (400 beyond).
    default_max_tokens: ``max_tokens`` when a request gives none (capped by the limit).
    lookahead: False decodes one token a forward (same text, for comparison).
    lookahead_config: drafter settings (default ``LookaheadConfig()``).
    k_prompt / k_seed: passages shown in the RAG prompt / retrieved in all (the rest seed the trie).
    max_stop / max_stop_chars: most stop strings in a request / longest stop string (400 beyond;
        each held-back character delays streamed text, each string costs a scan per step).
    max_messages: most chat messages in a request (400 beyond).
    max_body_bytes: largest request body (413 at once from Content-Length, or as soon as a
        streamed body passes it; nothing is parsed before).
    drain_seconds: on shutdown (SIGTERM), how long running and queued requests may finish while
        new ones get 503; what is left then gets an error.
    api_keys: with any, every endpoint but /health needs ``Authorization: Bearer <one of them>``.
    allowed_hosts: Host names accepted besides the bound host and loopback names ("*": any).
    output_pool: "shared" (one pool of earlier answers for everyone), "per-key" (one per API
        key; rows of different keys decode in separate forwards) or "off".
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"
    served_model_name: str | None = None
    dtype: str | None = None
    device: str | None = None
    device_map: str | None = None  # accelerate device map, e.g. "auto" over several GPUs
    index_dir: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 1024
    default_max_tokens: int = 256
    lookahead: bool = True
    lookahead_config: LookaheadConfig | None = None
    k_prompt: int = 3
    k_seed: int = 8
    max_stop: int = 16
    max_stop_chars: int = 256
    max_messages: int = 256
    max_body_bytes: int = 4 * MiB
    drain_seconds: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in logs
    allowed_hosts: tuple[str, ...] = ()
    output_pool: str = "shared"
    log_level: str = "info"

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_strings()
        self.api_keys = _key_tuple(self.api_keys)
        self.allowed_hosts = _host_tuple(self.allowed_hosts)
        if self.output_pool not in OUTPUT_POOL_MODES:
            raise ConfigError(f"output_pool must be one of {', '.join(OUTPUT_POOL_MODES)}, got {self.output_pool!r}")
        if self.output_pool == "per-key" and not self.api_keys:
            raise ConfigError("output_pool='per-key' needs API keys (--api-key or $RAG_LOOKAHEAD_API_KEY)")

    def _check_numbers(self) -> None:
        for name, (low, high) in _INT_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in {low}..{high}, got {value!r}")
        if self.k_seed < self.k_prompt:
            raise ConfigError(f"k_seed must be >= k_prompt ({self.k_prompt}), got {self.k_seed}")
        seconds = self.drain_seconds
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds <= 86_400:
            raise ConfigError(f"drain_seconds must be a number in 0..86400, got {seconds!r}")
        self.drain_seconds = float(seconds)
        if not isinstance(self.lookahead, bool):
            raise ConfigError(f"lookahead must be true or false, got {self.lookahead!r}")
        if self.lookahead_config is not None and not isinstance(self.lookahead_config, LookaheadConfig):
            raise ConfigError(f"lookahead_config must be a LookaheadConfig, got {type(self.lookahead_config).__name__}")

    def _check_strings(self) -> None:
        for name in ("host", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 4096:
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("served_model_name", "dtype", "device", "device_map", "index_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                setattr(self, name, value)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 4096):
                raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "qwen2.5-coder-0.5b-instruct" if self.model == "default" else str(self.model)


def _string_tuple(values, what: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, set, frozenset)):
        raise ConfigError(f"{what} must be a list of strings, got {type(values).__name__}")
    if len(values) > 1024:
        raise ConfigError(f"{what} holds {len(values)} entries; at most 1024")
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"{what} must hold strings, got {type(value).__name__}")
    return tuple(values)


def _key_tuple(keys) -> tuple[str, ...]:
    """API keys: 8-4096 visible ASCII characters each, so they travel in a header unchanged."""
    keys = _string_tuple(keys, "api_keys")
    for key in keys:
        if not 8 <= len(key) <= 4096 or not all("!" <= c <= "~" for c in key):
            raise ConfigError("an API key must be 8 to 4096 visible ASCII characters (no spaces)")
    return tuple(dict.fromkeys(keys))


def _host_tuple(hosts) -> tuple[str, ...]:
    hosts = _string_tuple(hosts, "allowed_hosts")
    out = []
    for host in hosts:
        name = host.strip().lower().rstrip(".")
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        if not name or len(name) > 253 or any(c in name for c in "/ \t@,"):
            raise ConfigError(f"allowed_hosts entries must be host names or addresses (or '*'), got {host!r}")
        out.append(name)
    return tuple(dict.fromkeys(out))


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with an HTTP status.

    ``message`` is for the user: never exception text or paths (those go to the log).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _internal_error(status: int, what: str, error: BaseException | None = None) -> ApiError:
    """Log ``error`` with a fresh id; the client gets ``what`` and the id, nothing more."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error id %s)", what, error_id, exc_info=(type(error), error, error.__traceback__) if error else None)
    return ApiError(status, f"{what} (error id {error_id}; the server log has the details)", "server_error")


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry later", "server_error", code="shutting_down")


def _engine_stopped() -> ApiError:
    return ApiError(
        503,
        "the generation engine is not running; the server log has the details",
        "server_error",
        code="engine_stopped",
    )


def _show(value: Any, limit: int = 60) -> str:
    """A request value quoted back in an error message, cut short."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- metrics


class Metrics:
    """Counters and gauges, written by the engine thread and the event loop, read by /metrics."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/rag", "/v1/models", "/health", "/metrics")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) -> n
        self.tokens_generated = 0
        self.forward_passes = 0
        self.prefills = 0
        self.row_steps = 0  # (row, decode forward) pairs
        self.step_tokens = 0  # tokens those row steps gained
        self.cancelled = 0
        self.completed = 0
        self.failed = 0
        self.engine_errors = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def request(self, endpoint: str, status: int) -> None:
        if endpoint not in self.ENDPOINTS:
            endpoint = "other"
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def render(self, queue_depth: int, batch_size: int, active: int, ready: bool) -> str:
        with self._lock:
            mean = self.step_tokens / self.row_steps if self.row_steps else 0.0
            lines: list[str] = []

            def metric(name: str, kind: str, help: str, samples: Sequence[tuple[str, float]]) -> None:
                lines.append(f"# HELP {name} {help}")
                lines.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    lines.append(f"{name}{labels} {_number(value)}")

            metric(
                "rag_lookahead_requests_total",
                "counter",
                "HTTP requests by endpoint and status code (499: the client left before the answer).",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
            )
            metric(
                "rag_lookahead_tokens_generated_total",
                "counter",
                "Tokens generated over all requests.",
                [("", self.tokens_generated)],
            )
            metric(
                "rag_lookahead_forward_passes_total",
                "counter",
                "Batched decode forwards (after prefills).",
                [("", self.forward_passes)],
            )
            metric(
                "rag_lookahead_prefills_total",
                "counter",
                "Prefill forwards (each admits one or more requests).",
                [("", self.prefills)],
            )
            metric("rag_lookahead_row_steps_total", "counter", "Decode steps summed over rows.", [("", self.row_steps)])
            metric(
                "rag_lookahead_mean_accepted_tokens",
                "gauge",
                "Tokens gained per row and decode forward (1.0 = plain decoding).",
                [("", mean)],
            )
            metric(
                "rag_lookahead_requests_completed_total",
                "counter",
                "Generation requests answered in full.",
                [("", self.completed)],
            )
            metric(
                "rag_lookahead_requests_cancelled_total",
                "counter",
                "Generation requests dropped because the client left.",
                [("", self.cancelled)],
            )
            metric(
                "rag_lookahead_requests_failed_total",
                "counter",
                "Generation requests ended with an error by the engine.",
                [("", self.failed)],
            )
            metric(
                "rag_lookahead_engine_errors_total",
                "counter",
                "Engine failures (prefill, step, retire); their requests got an error.",
                [("", self.engine_errors)],
            )
            metric(
                "rag_lookahead_prefill_seconds_total",
                "counter",
                "Seconds spent in prefills.",
                [("", self.prefill_seconds)],
            )
            metric(
                "rag_lookahead_decode_seconds_total",
                "counter",
                "Seconds spent in decode steps.",
                [("", self.decode_seconds)],
            )
        metric("rag_lookahead_queue_depth", "gauge", "Requests waiting for a batch slot.", [("", queue_depth)])
        metric("rag_lookahead_batch_size", "gauge", "Rows in the running batches.", [("", batch_size)])
        metric("rag_lookahead_requests_active", "gauge", "Requests being decoded.", [("", active)])
        metric("rag_lookahead_ready", "gauge", "1 once the engine has warmed up.", [("", 1 if ready else 0)])
        metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", [("", _rss_bytes())])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(round(float(value), 6))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return 0


# ---------------------------------------------------------------- requests and the engine


class _Request:
    """One generation request: tokens in, text events out through ``channel``.

    Events: ``("piece", text)`` any number of times, then exactly one ``("done", info)`` or
    ``("error", ApiError)``.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        stop: list[str],
        references: list[list[int]],
        tracker,
        pool_key: str = "",
        sampling=None,
    ) -> None:
        from rag_lookahead.decoding.sampling import SamplingParams

        self.id = uuid.uuid4().hex
        self.sampling = sampling or SamplingParams()  # greedy unless the request samples
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stop = stop
        self.references = references
        self.tracker = tracker
        self.pool_key = pool_key  # requests with the same key share an output pool and a batch
        self.loop = asyncio.get_running_loop()
        self.channel: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # the client left
        self.ended = False  # the engine sent the last event (done or error)
        self.finished = False  # the handler saw the last event
        self.steps = 0  # blocks accepted (the prefill's first token is one)
        self.submitted = time.perf_counter()

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.channel.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def end(self, event: tuple) -> None:
        """Send the last event (once)."""
        if not self.ended:
            self.ended = True
            self.emit(event)

    @property
    def live(self) -> bool:
        """Still worth decoding: nobody cancelled or ended it."""
        return not (self.cancelled or self.ended)


class Engine:
    """The engine thread: owns the model and the running :class:`DecodeBatch` of each output pool."""

    def __init__(self, model, tokenizer, config: ServerConfig | None = None, index=None) -> None:
        from rag_lookahead.tokens import eos_ids, pad_id

        self.config = config or ServerConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.index = index
        lookahead = self.config.lookahead_config or LookaheadConfig()
        if not lookahead.stop_words:
            lookahead = lookahead.with_tokenizer(tokenizer)
        if not self.config.lookahead:
            lookahead = lookahead.replace(enabled=False)
        self.lookahead = lookahead
        self.eos = frozenset(eos_ids(model, tokenizer))
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self.pad_id = pad_id(model, tokenizer, self.eos)  # the caller's tokenizer is left as it is
        if self.vocab_size and self.pad_id >= self.vocab_size:  # padding is masked, but must still embed
            self.pad_id = 0
        self.context_limit = getattr(model.config, "max_position_embeddings", None)
        self.max_batch_size = self.config.max_batch_size
        self.metrics = Metrics()
        self.ready = threading.Event()
        # Encoding runs in handler threads, decoding in the engine thread. Plain encode and decode
        # only read the Rust tokenizer (no padding or truncation is ever set), so they may overlap;
        # encodes are serialised among themselves, decodes never wait for a long encode.
        self.tokenizer_lock = threading.Lock()
        self.retrieval_lock = threading.Lock()
        self._pools: dict[str, Any] = {}  # output pool key -> OutputPool
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[str, _Request] = {}
        self._batches: dict[str, Any] = {}  # output pool key -> DecodeBatch
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._drain_deadline = math.inf
        self.error: BaseException | None = None  # why the engine stopped (warm-up failed, the thread died)

    @classmethod
    def from_config(cls, config: ServerConfig) -> Engine:
        """Load the model (and the index, when there is one) named by ``config``."""
        from rag_lookahead.models import load_model
        from rag_lookahead.rag.index import default_index_dir, load_index

        model, tokenizer = load_model(
            config.model, dtype=config.dtype, device=config.device, device_map=config.device_map
        )
        index = None
        if config.index_dir is not None:
            index = load_index(config.index_dir)  # asked for explicitly: fail loudly
        elif default_index_dir().is_dir():
            try:
                index = load_index(default_index_dir())
            except Exception as e:  # the default is optional: serve without RAG
                log.warning("default index at %s not loaded (%s); /v1/rag will answer 503", default_index_dir(), e)
        return cls(model, tokenizer, config, index)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        if self._thread is None:
            self._stopping = self._draining = False
            self._drain_deadline = math.inf
            self._thread = threading.Thread(target=self._run, name="rag-lookahead-engine", daemon=True)
            self._thread.start()
        return self

    def begin_drain(self, seconds: float) -> None:
        """Stop admitting new requests (503); those already accepted may finish within ``seconds``,
        then whatever is left gets an error."""
        with self._cond:
            deadline = time.monotonic() + max(float(seconds), 0.0)
            self._drain_deadline = min(self._drain_deadline, deadline)
            self._draining = True
            self._cond.notify_all()

    def stop(self, drain_seconds: float = 0.0, timeout: float = 60.0) -> None:
        """Drain for up to ``drain_seconds``, then end the engine thread (what is left gets 503)."""
        self.begin_drain(drain_seconds)
        deadline = time.monotonic() + drain_seconds + timeout
        while self.alive and not self.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._active

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return sum(len(batch.rows) for batch in list(self._batches.values()))

    @property
    def active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------ tokenizing (handler side, worker threads)

    def encode_text(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages through the chat template, as :class:`LookaheadLLM` encodes its prompts."""
        with self.tokenizer_lock:
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            text = "\n\n".join(m["content"] for m in messages)
            return list(self.tokenizer(text)["input_ids"])

    def encode_passages(self, passages: Sequence[str]) -> list[list[int]]:
        with self.tokenizer_lock:
            return [self.tokenizer.encode(p, add_special_tokens=False) for p in passages if p]

    def new_request(
        self, prompt_ids: list[int], max_tokens: int, stop: list[str], references=(), pool_key: str = "", sampling=None
    ) -> _Request:
        """``sampling``: a :class:`rag_lookahead.decoding.sampling.SamplingParams` (default greedy); rows with
        different settings share one batch, and a seeded row's text does not depend on the batch."""
        from rag_lookahead.tokens import TextTracker

        tracker = TextTracker(self.tokenizer, stop, self.eos)
        key = pool_key if self.config.output_pool == "per-key" else ""
        return _Request(list(prompt_ids), max_tokens, list(stop), [list(r) for r in references], tracker, key, sampling)

    # ------------------------------------------------------------ queue (handler side)

    def _refusal(self) -> ApiError | None:
        """Why a new request cannot be taken now (call with ``_cond`` held)."""
        if self.error is not None or (self._thread is not None and not self._thread.is_alive()):
            return _engine_stopped()
        if self._stopping or self._draining:
            return _shutting_down()
        if len(self._waiting) >= self.config.max_queue:
            return ApiError(
                429,
                f"the server is busy: {len(self._waiting)} requests are already waiting (max_queue={self.config.max_queue}); retry later",
                "rate_limit_error",
            )
        return None

    def check_capacity(self) -> None:
        """Raise the 429/503 that ``submit`` would, before a handler spends work on a request."""
        with self._cond:
            refusal = self._refusal()
        if refusal is not None:
            raise refusal

    def submit(self, request: _Request) -> None:
        with self._cond:
            refusal = self._refusal()
            if refusal is not None:
                raise refusal
            self._waiting.append(request)
            self._cond.notify_all()

    def cancel(self, request: _Request) -> None:
        """The client left: drop the request from the queue, or from the batch at the next step."""
        with self._cond:
            if request.cancelled or request.finished or request.ended:
                return
            request.cancelled = True
            try:
                self._waiting.remove(request)
            except ValueError:
                return  # in a batch (or being admitted): the engine retires it and counts it
        self.metrics.add(cancelled=1)

    # ------------------------------------------------------------ the engine thread

    def _pool(self, key: str):
        """The output pool of ``key`` (created on first use), or None when pools are off."""
        from rag_lookahead.decoding.trie import OutputPool

        if self.config.output_pool == "off":
            return None
        pool = self._pools.get(key)
        if pool is None:
            nodes = self.lookahead.output_pool_nodes
            if self.config.output_pool == "per-key":  # the pools together stay within the one bound
                nodes = max(nodes // max(len(self.config.api_keys), 1), 1)
            pool = self._pools[key] = OutputPool(self.lookahead.branch_length + self.lookahead.max_key_length, nodes)
        return pool

    def _new_batch(self, key: str = ""):
        from rag_lookahead.decoding.loop import DecodeBatch

        return DecodeBatch(self.model, self.lookahead, self.eos, self._pool(key))

    def _run(self) -> None:
        """The engine thread. Whatever ends it, every request still waiting gets an error at once."""
        import torch

        clean = False
        try:
            if self._warm_up():
                with torch.inference_mode():
                    while self._serve_once():
                        pass
            clean = True
        except BaseException as e:  # noqa: BLE001 - the thread dies: tell every client and /health
            self.error = e
            _internal_error(503, "the generation engine stopped", e)
        finally:
            with self._cond:
                self._stopping = True
            self._fail_everything(_shutting_down() if clean and self.error is None else _engine_stopped())

    def _warm_up(self) -> bool:
        """Measure the tree-mask probe and the cost curve once, not inside a request's latency."""
        try:
            self._new_batch()
            from rag_lookahead.decoding.verify import supports_tree_mask

            # rows share one packed cache kept apart by the mask, drafting or not
            if self.max_batch_size > 1 and not supports_tree_mask(self.model):
                log.warning("this model ignores custom attention masks: decoding one request at a time")
                self.max_batch_size = 1
        except Exception as e:  # noqa: BLE001 - reported by /health and to every request
            self.error = e
            _internal_error(503, "engine warm-up failed", e)
            return False
        self.ready.set()
        return True

    def _serve_once(self) -> bool:
        """One round: retire, admit, step. False once the engine is stopping."""
        admitted: list[_Request] | None = []
        try:
            self._retire_all()
            admitted = self._take_waiting()
            if admitted is None:
                return False
            if admitted:
                self._admit(admitted)
                self._retire_all()
            self._step_all()
        except Exception as e:  # noqa: BLE001 - a bug between the guarded parts: fail what runs, carry on
            self._fail_requests(list(self._active.values()) + list(admitted or ()), self._failure(e))
            self._active.clear()
            self._batches.clear()
        return True

    def _take_waiting(self) -> list[_Request] | None:
        """Wait for work; return the requests to admit ([] when only stepping), None when stopping."""
        with self._cond:
            while not self._stopping:
                expired = self._draining and time.monotonic() >= self._drain_deadline
                if expired and not self.idle:
                    break
                if not expired and (self._waiting or self.batch_size):
                    room = self.max_batch_size - self.batch_size
                    return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                until_deadline = self._drain_deadline - time.monotonic()
                self._cond.wait(timeout=min(1.0, until_deadline) if until_deadline > 0 else 1.0)
            else:
                return None
        self._fail_everything(_shutting_down())  # the drain time is over: what is left gets an error
        return []

    # ------------------------------------------------------------ admit

    def _admit(self, requests: list[_Request]) -> None:
        """One prefill per output pool for the admitted requests, merged into its running batch."""
        dropped = [r for r in requests if r.cancelled]
        if dropped:  # cancelled between leaving the queue and the prefill
            self.metrics.add(cancelled=len(dropped))
        groups: dict[str, list[_Request]] = {}
        for r in requests:
            if r.live:
                groups.setdefault(r.pool_key, []).append(r)
        for key, group in groups.items():
            self._admit_group(key, group)

    def _admit_group(self, key: str, group: list[_Request]) -> None:
        """Prefill ``group``; on failure retry one by one so only the request at fault fails."""
        try:
            batch = self._batches.get(key)
            if batch is None:
                batch = self._new_batch(key)
        except Exception as e:  # noqa: BLE001
            self._fail_requests(group, self._failure(e))
            return
        rows_before = len(batch.rows)
        for request in group:  # active from here on: a drain or a test waiting for idle sees the prefill
            self._active[request.id] = request
        try:
            self._prefill(batch, group)
        except Exception as e:  # noqa: BLE001
            if len(batch.rows) != rows_before:  # it failed half-way through the merge: the batch is unsafe
                self._fail_batch(key, e, also=group)
                return
            for request in group:
                self._active.pop(request.id, None)
            if len(group) > 1:
                for request in group:
                    self._admit_group(key, [request])
            else:
                self._fail_requests(group, self._failure(e))
            return
        self._batches[key] = batch

    def _prefill(self, batch, requests: list[_Request]) -> None:
        from rag_lookahead.decoding.loop import left_pad
        from rag_lookahead.decoding.verify import input_device

        device = input_device(self.model)
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad_id, device)
        references = [r.references for r in requests] if any(r.references for r in requests) else None
        start = time.perf_counter()
        rows = batch.add(
            ids,
            mask,
            references,
            [r.max_tokens for r in requests],
            keys=[r.id for r in requests],
            sampling=[r.sampling for r in requests],
        )
        self.metrics.add(prefills=1, prefill_seconds=time.perf_counter() - start)
        for request, row in zip(requests, rows):
            self._deliver(request, row.generated)

    # ------------------------------------------------------------ step

    def _step_all(self) -> None:
        for key, batch in list(self._batches.items()):
            if not batch.rows:
                continue
            try:
                gained = self._step(batch)
            except Exception as e:  # noqa: BLE001 - which row is at fault is unknown: the batch fails
                self._fail_batch(key, e)
                continue
            for row, new in zip(list(batch.rows), gained):
                request = self._active.get(row.index)
                if request is not None:
                    self._deliver(request, new)

    def _step(self, batch) -> list[list[int]]:
        start = time.perf_counter()
        drafts = batch.propose()
        gained = batch.verify_and_accept(drafts)
        self.metrics.add(
            forward_passes=1,
            row_steps=len(gained),
            step_tokens=sum(len(g) for g in gained),
            decode_seconds=time.perf_counter() - start,
        )
        return gained

    def _deliver(self, request: _Request, tokens: list[int]) -> None:
        """Turn a row's new tokens into text for its client; a failure here fails that request only."""
        if not tokens or not request.live:
            return
        request.steps += 1
        self.metrics.add(tokens_generated=len(tokens))
        try:
            piece = request.tracker.add(tokens)
        except Exception as e:  # noqa: BLE001
            self._fail_requests([request], self._failure(e))
            return
        if piece:
            request.emit(("piece", piece))

    # ------------------------------------------------------------ retire

    def _retire_all(self) -> None:
        """Remove finished, stopped, cancelled and failed rows from every batch; answer them."""
        for key, batch in list(self._batches.items()):
            if batch.rows:
                try:
                    left = batch.finish(self._keep)
                except Exception as e:  # noqa: BLE001 - the batch's bookkeeping is unknown now
                    self._fail_batch(key, e)
                    continue
                for row in left:
                    self._answer(row)
            if not batch.rows:
                self._batches.pop(key, None)  # frees the KV cache; the next admission starts afresh

    def _keep(self, row) -> bool:
        request = self._active.get(row.index)
        return request is not None and request.live and not request.tracker.stopped

    def _answer(self, row) -> None:
        """Send a retired row's last event (or count it cancelled)."""
        request = self._active.pop(row.index, None)
        if request is None or request.ended:
            return
        if request.cancelled:
            request.ended = True
            self.metrics.add(cancelled=1)
            return
        try:
            info = self._final_info(request, row)
        except Exception as e:  # noqa: BLE001
            self._fail_requests([request], self._failure(e))
            return
        self.metrics.add(completed=1)
        request.end(("done", info))

    def _final_info(self, request: _Request, row) -> dict:
        tracker = request.tracker
        rest = tracker.rest()
        text = tracker.final_text()
        stopped = tracker.stopped or bool(row.generated and row.generated[-1] in self.eos)
        decode_steps = max(request.steps - 1, 0)
        return {
            "text": text,
            "rest": rest,
            "finish_reason": "stop" if stopped else "length",
            "prompt_tokens": len(request.prompt_ids),
            "completion_tokens": len(row.generated),
            "forward_passes": decode_steps,
            "mean_accepted": round((len(row.generated) - 1) / decode_steps, 4) if decode_steps else 0.0,
            "seconds": round(time.perf_counter() - request.submitted, 4),
            "lookahead": self.lookahead.enabled,
        }

    # ------------------------------------------------------------ failing requests

    def _failure(self, cause: BaseException) -> ApiError:
        """Count and log an engine failure; the error its requests get (no internals in it)."""
        self.metrics.add(engine_errors=1)
        return _internal_error(500, "generation failed", cause)

    def _fail_requests(self, requests: Sequence[_Request], error: ApiError) -> None:
        """End each request with ``error``; their rows (if any) are dropped at the next retire.

        A request whose client already left ends silently (counted as cancelled: nothing counted it
        yet, since only requests still in the queue are counted when they are cancelled)."""
        for request in requests:
            if request.ended:
                continue
            if request.cancelled:
                request.ended = True
                self.metrics.add(cancelled=1)
            else:
                self.metrics.add(failed=1)
                request.end(("error", error))

    def _fail_batch(self, key: str, cause: BaseException, also: Sequence[_Request] = ()) -> None:
        """A failure that cannot be pinned on one row: every request of the batch gets the error.

        The batch's requests are the active ones of its pool key, not ``batch.rows``: a failure
        half-way through ``finish`` may have taken rows out already."""
        self._batches.pop(key, None)
        requests = {r.id: r for r in also}
        requests.update((r.id, r) for r in self._active.values() if r.pool_key == key)
        for request_id in requests:
            self._active.pop(request_id, None)
        self._fail_requests(list(requests.values()), self._failure(cause))

    def _fail_everything(self, error: ApiError) -> None:
        """Every running and waiting request gets ``error`` (shutdown, drain over, the engine died)."""
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        running = list(self._active.values())
        self._active.clear()
        self._batches.clear()
        self._fail_requests(running + waiting, error)

    # ------------------------------------------------------------ retrieval (handler side, in a worker thread)

    def retrieve(self, question: str, k: int):
        from langchain_core.documents import Document

        with self.retrieval_lock:
            passages = self.index.search(question, k)
        return [
            Document(page_content=p.text, metadata={"source": p.source, "chunk_id": p.chunk_id, "score": p.score})
            for p in passages
        ]


# ---------------------------------------------------------------- request validation


def _get_int(body: dict, name: str, default: int | None, low: int, high: int | None, hint: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be an integer, got {_show(value)}", param=name)
    if value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ApiError(400, f"'{name}' must be {span}{hint}, got {_show(value)}", param=name)
    return value


def _get_number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(400, f"'{name}' must be a number in {span}, got {_show(value)}", param=name)
    return float(value)


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {_show(value)}", param=name)
    return value


@dataclass(frozen=True)
class SamplingRequest:
    """How the request asks each next token to be chosen (OpenAI's names, plus vLLM's ``top_k``,
    ``min_p`` and ``repetition_penalty``). ``None``: not given. ``temperature`` 0 or absent is
    greedy (lossless either way: sampled rows draw exactly from the model's distribution)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature

    def params(self, choice: int = 0):
        """The core's :class:`SamplingParams` for choice ``choice`` of ``n`` (seed + choice)."""
        from rag_lookahead.decoding.sampling import SamplingParams

        seed = None if self.seed is None else (self.seed + choice) % (1 << 63)
        penalty = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        if self.greedy:
            return SamplingParams(repetition_penalty=penalty)
        return SamplingParams(
            do_sample=True,
            temperature=self.temperature,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,  # 0 and -1: off, as in vLLM
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or None,
            repetition_penalty=penalty,
            seed=seed,
        )


_MAX_CHOICES = 8


def _sampling_params(body: dict) -> SamplingRequest:
    return SamplingRequest(
        temperature=_get_number(body, "temperature", 0.0, 2.0),
        top_p=_get_number(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=_get_int(body, "top_k", None, -1, 1 << 31),
        min_p=_get_number(body, "min_p", 0.0, 1.0),
        repetition_penalty=_get_number(body, "repetition_penalty", 0.0, 10.0, low_open=True),
        seed=_get_int(body, "seed", None, -(1 << 63), (1 << 64) - 1),
    )


@dataclass
class _Params:
    model: str
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    n: int = 1  # independent choices (seeded: seed, seed + 1, ...)


def _refuse_unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise ApiError(
                400,
                f"'{name}' is not supported (use repetition_penalty, as transformers applies it): leave it out",
                param=name,
            )
    for name, what in (
        ("logit_bias", "'logit_bias'"),
        ("logprobs", "'logprobs'"),
        ("top_logprobs", "'logprobs'"),
        ("echo", "'echo'"),
        ("suffix", "'suffix'"),
    ):
        if body.get(name):
            raise ApiError(400, f"{what} is not supported by this server", param=name)


def _stop_strings(body: dict, cfg: ServerConfig) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > cfg.max_stop:
        raise ApiError(
            400, f"'stop' has {len(stop)} strings; at most {cfg.max_stop} are allowed (max_stop)", param="stop"
        )
    if any(len(s) > cfg.max_stop_chars for s in stop):
        raise ApiError(
            400, f"a 'stop' string is longer than {cfg.max_stop_chars} characters (max_stop_chars)", param="stop"
        )
    return [s for s in stop if s]


def _common_params(body: dict, engine: Engine, max_tokens_names: Sequence[str] = ("max_tokens",)) -> _Params:
    cfg = engine.config
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > 256):
        raise ApiError(400, "'model' must be a string of at most 256 characters", param="model")
    n = _get_int(body, "n", 1, 1, _MAX_CHOICES, f" (at most {_MAX_CHOICES} choices a request)")
    _get_int(body, "best_of", 1, 1, 1, " (best_of is not supported)")
    sampling = _sampling_params(body)
    if n > 1 and _get_bool(body, "stream"):
        raise ApiError(400, "'n' > 1 is not supported with 'stream': send n requests instead", param="n")
    _refuse_unsupported(body)
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _get_int(
            body, name, None, 1, cfg.max_tokens_limit, f" (the server's max_tokens limit is {cfg.max_tokens_limit})"
        )
        if max_tokens is not None:
            break
    if max_tokens is None:
        max_tokens = min(cfg.default_max_tokens, cfg.max_tokens_limit)
    stop = _stop_strings(body, cfg)
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = _get_bool(options or {}, "include_usage")
    return _Params(model or cfg.model_name, max_tokens, stop, stream, include_usage, sampling, n)


def _check_prompt(ids: list[int], engine: Engine) -> list[int]:
    cfg = engine.config
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) > cfg.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; this server accepts at most {cfg.max_prompt_tokens} (max_prompt_tokens)",
            param="prompt",
        )
    if engine.context_limit is not None and len(ids) >= engine.context_limit:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens but the model's context holds {engine.context_limit}",
            param="prompt",
        )
    if engine.vocab_size and any(t >= engine.vocab_size for t in ids):
        raise ApiError(
            400, f"the prompt holds token ids outside the model's vocabulary (size {engine.vocab_size})", param="prompt"
        )
    return ids


def _completion_prompt(body: dict, engine: Engine) -> str | list[int]:
    """The prompt as given: text (to tokenize off the event loop) or checked token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and len(prompt) > engine.config.max_prompt_tokens:
        _check_prompt(prompt, engine)  # too long: refused before looking at every element
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise ApiError(400, "token ids in 'prompt' must be >= 0", param="prompt")
        return _check_prompt(list(prompt), engine)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "'prompt' holds several prompts: send one prompt per request", param="prompt")
    raise ApiError(400, "'prompt' is required: a string or a list of token ids", param="prompt")


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _chat_messages(body: dict, cfg: ServerConfig) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages")
    if len(messages) > cfg.max_messages:
        raise ApiError(
            400,
            f"'messages' has {len(messages)} entries; at most {cfg.max_messages} are allowed (max_messages)",
            param="messages",
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if role not in _ROLES:
            raise ApiError(
                400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {_show(role)}", param="messages"
            )
        out.append(
            {"role": "system" if role == "developer" else role, "content": _message_text(message.get("content"), i)}
        )
    if not any(m["content"].strip() for m in out):
        raise ApiError(400, "every message is empty", param="messages")
    return out


def _message_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f'messages[{i}].content parts must be {{"type": "text", "text": ...}} (text only)',
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return content


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a clear 400 for anything else (NaN, lone surrogates, deep nesting)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # strings with lone surrogates (\\ud800) cannot be tokenized or sent back
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds invalid Unicode (a lone surrogate escape)") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    return body


# ---------------------------------------------------------------- responses


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


class _ClientGone(Exception):
    pass


async def _events(request: _Request, engine: Engine, http_request: Request | None = None) -> AsyncIterator[tuple]:
    """The request's events, the last one "done" or "error".

    Every ``CLIENT_CHECK_SECONDS``, events flowing or not, it looks whether the client left (when
    ``http_request`` is given: the request is cancelled, ``_ClientGone`` raised); after
    ``POLL_SECONDS`` without an event, whether the engine thread is gone (an error event, so no
    client waits forever). One pending ``get`` is kept across polls, so no event is lost to a
    timeout.
    """
    getter: asyncio.Future | None = None
    looked = time.monotonic()
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(request.channel.get())
            done, _ = await asyncio.wait((getter,), timeout=min(POLL_SECONDS, CLIENT_CHECK_SECONDS))
            if http_request is not None and time.monotonic() - looked >= CLIENT_CHECK_SECONDS:
                looked = time.monotonic()
                if await http_request.is_disconnected():
                    engine.cancel(request)
                    raise _ClientGone()
            if not done:
                if not engine.alive and request.channel.empty():
                    request.finished = True
                    yield ("error", _engine_stopped())
                    return
                continue
            event, getter = getter.result(), None
            if event[0] != "piece":
                request.finished = True
            yield event
            if event[0] != "piece":
                return
    finally:
        if getter is not None:
            getter.cancel()


async def _collect(request: _Request, http_request: Request, engine: Engine) -> dict:
    """Wait for the whole answer; returns the engine's final info."""
    try:
        async with contextlib.aclosing(_events(request, engine, http_request)) as events:
            async for event in events:
                if event[0] == "done":
                    return event[1]
                if event[0] == "error":
                    raise event[1]
        raise _engine_stopped()  # unreachable: the events end with done or error
    finally:
        if not request.finished:
            engine.cancel(request)


def _usage(info: dict) -> dict:
    return {
        "prompt_tokens": info["prompt_tokens"],
        "completion_tokens": info["completion_tokens"],
        "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
    }


def _sum_usage(infos: list[dict]) -> dict:
    """Usage of all choices: the prompt counted once, completions added up (as OpenAI reports n > 1)."""
    usages = [_usage(info) for info in infos]
    completion = sum(u["completion_tokens"] for u in usages)
    prompt = usages[0]["prompt_tokens"]
    return {**usages[0], "completion_tokens": completion, "total_tokens": prompt + completion}


def _stats(info: dict) -> dict:
    return {k: info[k] for k in ("forward_passes", "mean_accepted", "seconds", "lookahead")}


async def _stream(
    request: _Request,
    http_request: Request,
    engine: Engine,
    make_chunk,
    include_usage: bool,
    first: list | None = None,
    final=None,
):
    """Server-sent events: ``make_chunk(text, finish_reason)`` shapes each one.

    It looks for the client's disconnect itself while it waits: under ASGI 2.4 servers Starlette
    no longer listens for it, and a queued request would otherwise be decoded for nobody."""
    try:
        for payload in first or ():
            yield _sse(payload)
        async with contextlib.aclosing(_events(request, engine, http_request)) as events:
            async for event in events:
                if event[0] == "piece":
                    yield _sse(make_chunk(event[1], None))
                elif event[0] == "done":
                    for payload in _last_chunks(event[1], make_chunk, include_usage, final):
                        yield _sse(payload)
                    yield _DONE
                else:
                    yield _sse(event[1].body())
                    yield _DONE
    except _ClientGone:
        return
    finally:  # the client left (the generator was cancelled or closed) or we are done
        if not request.finished:
            engine.cancel(request)


def _last_chunks(info: dict, make_chunk, include_usage: bool, final) -> list:
    """The chunks after the last piece: the held-back rest, then the finish (and usage) chunk."""
    chunks = [make_chunk(info["rest"], None)] if info["rest"] else []
    if final is not None:
        return chunks + [final(info)]
    chunks.append(make_chunk(None, info["finish_reason"]))
    if include_usage:
        chunks.append(make_chunk(None, None, usage=_usage(info)))
    return chunks


class _EngineStream(StreamingResponse):
    """A stream that cancels its request however the response ends, even when the client left
    before the stream's first chunk (then the generator never runs, so its own cleanup cannot)."""

    def __init__(self, content, engine: Engine, request: _Request) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.engine, self.request = engine, request

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.request.finished:
                self.engine.cancel(self.request)


# ---------------------------------------------------------------- middleware


async def _send_error(send, error: ApiError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error.body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": error.status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _host_name(value: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``; lower case, no final dot;
    "" when the port is not a number."""
    value = value.strip().lower()
    port = ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 :][:1] not in ("", ":"):
            return ""
        value, port = value[1:end], value[end + 2 :]
    elif value.count(":") == 1:
        value, port = value.split(":")
    if port and not port.isdigit():
        return ""
    return value.rstrip(".")


def _origin_host(origin: str) -> str | None:
    """The host name of an ``Origin`` header (``http://localhost:3000`` -> ``localhost``); None if opaque."""
    scheme, sep, rest = origin.strip().partition("://")
    if not sep or not scheme:
        return None
    return _host_name(rest.split("/", 1)[0]) or None


class _Gate:
    """ASGI middleware in front of every handler, before any body is read:

    1. ``Host`` must name this server (the bound host, a loopback name or ``allowed_hosts``):
       a DNS-rebinding page reaches a loopback port under its own name and is refused (421); a
       browser ``Origin`` must pass the same test (403), so no web page can drive the server.
    2. With API keys, ``Authorization: Bearer KEY`` on every path but ``/health`` (401). Keys are
       compared as SHA-256 digests with ``hmac.compare_digest`` against all keys, so the time
       taken says nothing about them; the handler learns only the digest's short id.
    3. A declared ``Content-Length`` above ``max_body_bytes``: 413 at once.
    """

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        hosts = set(LOOPBACK) | set(config.allowed_hosts)
        if config.host not in WILDCARD_BINDS:
            hosts.add(_host_name(config.host) or config.host.lower())
        self.hosts = None if "*" in hosts else frozenset(hosts)
        self.keys = [
            (hashlib.sha256(k.encode()).digest(), hashlib.sha256(k.encode()).hexdigest()[:16]) for k in config.api_keys
        ]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
        error = self._check_host(headers) or self._check_key(scope, headers) or self._check_length(headers)
        if error is not None:
            # no "Connection: close" on a 413: closing while the client still uploads resets the
            # connection, and it may never read the answer; uvicorn discards the declared rest
            extra = [(b"www-authenticate", b"Bearer")] if error.status == 401 else []
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _send_error(send, error, extra)
        await self.app(scope, receive, send)

    def _check_host(self, headers: dict[str, list[str]]) -> ApiError | None:
        if self.hosts is None:
            return None
        hosts = headers.get("host", [])
        if len(hosts) != 1 or _host_name(hosts[0]) not in self.hosts:
            return ApiError(
                421,
                "this server does not answer to that Host name (start it with --allowed-hosts NAME to allow it)",
                code="invalid_host",
            )
        for origin in headers.get("origin", []):
            if _origin_host(origin) not in self.hosts:
                return ApiError(403, "requests from web pages of other origins are refused", code="invalid_origin")
        return None

    def _check_key(self, scope, headers: dict[str, list[str]]) -> ApiError | None:
        if not self.keys or scope.get("path") in self.OPEN_PATHS:
            return None
        given = headers.get("authorization", [""])[0]
        scheme, _, token = given.partition(" ")
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        matched = ""
        for key_digest, key_id in self.keys:  # all of them, whatever matched: constant work
            if hmac.compare_digest(digest, key_digest) and scheme.lower() == "bearer":
                matched = key_id
        if not matched:
            return ApiError(
                401, "a valid API key is required: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key"
            )
        scope.setdefault("state", {})["key_id"] = matched
        return None

    def _check_length(self, headers: dict[str, list[str]]) -> ApiError | None:
        lengths = headers.get("content-length", [])
        if not lengths:
            return None
        if len(lengths) > 1 or not lengths[0].strip().isdigit():
            return ApiError(400, "the Content-Length header is not a single number")
        if int(lengths[0]) > self.max_body:
            return _too_large(self.max_body)
        return None


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes, max_body_bytes)",
        code="body_too_large",
    )


class _CountRequests:
    """ASGI middleware: counts responses by endpoint and status for /metrics."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.request(scope.get("path", ""), status[0])


# ---------------------------------------------------------------- the app


async def _read_json(request: Request, limit: int) -> dict:
    """The body, counted as it streams in (413 past ``limit``), parsed off the event loop."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    raw = b"".join(chunks)
    return await run_in_threadpool(_parse_json, raw) if len(raw) > 65536 else _parse_json(raw)


def _template_error(error: Exception) -> ApiError:
    """The chat template refused the messages: its own message when it raised one on purpose."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - transformers needs jinja2 for templates
        TemplateError = ()  # type: ignore[assignment]
    if isinstance(error, TemplateError) and str(error) and len(str(error)) <= 300:
        return ApiError(400, f"the chat template rejected these messages: {error}", param="messages")
    log.info("chat template failed", exc_info=(type(error), error, error.__traceback__))
    return ApiError(400, "the chat template rejected these messages", param="messages")


def create_app(engine_or_config: Engine | ServerConfig | None = None):
    """The FastAPI app. Given a config it loads the model; the engine thread starts with the app
    (lifespan) and stops with it, after draining for ``drain_seconds``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if engine_or_config is None:
        engine_or_config = ServerConfig()
    engine = engine_or_config if isinstance(engine_or_config, Engine) else Engine.from_config(engine_or_config)
    cfg = engine.config

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop, cfg.drain_seconds)

    app = FastAPI(
        title="rag_lookahead", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine = engine
    app.add_middleware(_Gate, config=cfg)
    app.add_middleware(_CountRequests, metrics=engine.metrics)  # outermost: counts the gate's refusals too
    ids = itertools.count()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        # a streamed (chunked) body past the limit has no declared end to discard up to: close
        headers = {"Connection": "close"} if err.status == 413 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, err: _ClientGone):
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = {404: "no such endpoint", 405: "this endpoint does not take that method"}.get(
            err.status_code, "invalid request"
        )
        return JSONResponse(ApiError(err.status_code, message, kind).body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(ApiError(400, "invalid request").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        return JSONResponse(_internal_error(500, "internal error", err).body(), status_code=500)

    def make_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(ids)}"

    def key_of(http_request: Request) -> str:
        return getattr(http_request.state, "key_id", "")

    async def read_body(http_request: Request) -> dict:
        engine.check_capacity()  # 429/503 before reading, parsing or tokenizing anything
        return await _read_json(http_request, cfg.max_body_bytes)

    async def encode(fn: Callable, *args) -> list[int]:
        return await run_in_threadpool(fn, *args)

    async def non_stream(request: _Request, http_request: Request) -> dict | Response:
        try:
            return await _collect(request, http_request, engine)
        except _ClientGone:
            return Response(status_code=499)

    def submit_choices(prompt: list[int], params: _Params, http_request: Request) -> list[_Request]:
        """One request per choice (``n``); choice i of a seeded request draws with seed + i."""
        requests = [
            engine.new_request(
                prompt,
                params.max_tokens,
                params.stop,
                pool_key=key_of(http_request),
                sampling=params.sampling.params(i),
            )
            for i in range(params.n)
        ]
        for request in requests:
            engine.submit(request)
        return requests

    async def collect_choices(requests: list[_Request], http_request: Request) -> list[dict] | Response:
        infos = await asyncio.gather(*(non_stream(r, http_request) for r in requests))
        for info in infos:
            if isinstance(info, Response):
                for r in requests:
                    engine.cancel(r)
                return info
        return list(infos)

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await read_body(http_request)
        params = _common_params(body, engine)
        prompt = _completion_prompt(body, engine)
        if isinstance(prompt, str):
            prompt = _check_prompt(await encode(engine.encode_text, prompt), engine)
        requests = submit_choices(prompt, params, http_request)
        request = requests[0]
        rid, created = make_id("cmpl"), int(time.time())

        def chunk(text: str | None, finish_reason: str | None, usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": params.model}
            out["choices"] = (
                [] if usage else [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}]
            )
            if usage:
                out["usage"] = usage
            return out

        if params.stream:
            return _EngineStream(_stream(request, http_request, engine, chunk, params.include_usage), engine, request)
        infos = await collect_choices(requests, http_request)
        if isinstance(infos, Response):
            return infos
        out = chunk(None, None, usage=_sum_usage(infos))
        out["choices"] = [
            {"text": info["text"], "index": i, "logprobs": None, "finish_reason": info["finish_reason"]}
            for i, info in enumerate(infos)
        ]
        out["stats"] = _stats(infos[0])
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await read_body(http_request)
        params = _common_params(body, engine, ("max_completion_tokens", "max_tokens"))
        if body.get("tools") or body.get("functions"):
            raise ApiError(400, "tool and function calling are not supported by this server", param="tools")
        messages = _chat_messages(body, cfg)
        try:
            prompt = await encode(engine.encode_chat, messages)
        except Exception as e:  # a template that refuses this conversation (e.g. role order)
            raise _template_error(e) from None
        requests = submit_choices(_check_prompt(prompt, engine), params, http_request)
        request = requests[0]
        rid, created = make_id("chatcmpl"), int(time.time())

        def chunk(text: str | None, finish_reason: str | None, usage: dict | None = None, first: bool = False) -> dict:
            out = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": params.model,
                "system_fingerprint": None,
            }
            if usage:
                out["choices"], out["usage"] = [], usage
                return out
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
            return out

        if params.stream:
            events = _stream(
                request, http_request, engine, chunk, params.include_usage, first=[chunk(None, None, first=True)]
            )
            return _EngineStream(events, engine, request)
        infos = await collect_choices(requests, http_request)
        if isinstance(infos, Response):
            return infos
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": params.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": info["text"]},
                    "logprobs": None,
                    "finish_reason": info["finish_reason"],
                }
                for i, info in enumerate(infos)
            ],
            "usage": _sum_usage(infos),
            "stats": _stats(infos[0]),
        }

    @app.post("/v1/rag")
    async def rag(http_request: Request):
        from rag_lookahead.rag.chains import make_prompt, source_info

        body = await read_body(http_request)
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ApiError(400, "'question' is required: a non-empty string", param="question")
        k = _get_int(body, "k", cfg.k_prompt, 1, 32, " (passages shown to the model)")
        max_tokens = _get_int(
            body,
            "max_tokens",
            min(cfg.default_max_tokens, cfg.max_tokens_limit),
            1,
            cfg.max_tokens_limit,
            f" (the server's max_tokens limit is {cfg.max_tokens_limit})",
        )
        stream = _get_bool(body, "stream")
        if engine.index is None:
            raise ApiError(
                503,
                "no document index is loaded: build one with `rag_lookahead index CORPUS_DIR --index-dir DIR` "
                "and start the server with `--index-dir DIR`",
                "server_error",
            )
        if len(await encode(engine.encode_text, question)) > cfg.max_prompt_tokens:  # before the costly retrieval
            raise ApiError(
                400,
                f"'question' is longer than this server's prompt limit ({cfg.max_prompt_tokens} tokens)",
                param="question",
            )
        engine.check_capacity()  # again: the tokenizing may have taken a while
        k_seed = max(cfg.k_seed, k)
        start = time.perf_counter()
        try:
            docs = await run_in_threadpool(engine.retrieve, question, k_seed)
        except InputError as e:
            raise ApiError(400, str(e)[:300], param="question") from None
        retrieval_seconds = time.perf_counter() - start
        shown, seeds = docs[:k], docs[k:]
        prompt = await encode(engine.encode_chat, [{"role": "user", "content": make_prompt(question, shown)}])
        references = (
            await encode(engine.encode_passages, [d.page_content for d in seeds]) if engine.lookahead.enabled else []
        )
        request = engine.new_request(
            _check_prompt(prompt, engine), max_tokens, [], references, pool_key=key_of(http_request)
        )
        engine.submit(request)
        sources = [source_info(d, i < k) for i, d in enumerate(docs)]

        def stats(info: dict) -> dict:
            return {
                **_stats(info),
                "retrieval_seconds": round(retrieval_seconds, 4),
                "seed_passages": len(seeds),
                "finish_reason": info["finish_reason"],
                "usage": _usage(info),
            }

        if stream:
            events = _stream(
                request,
                http_request,
                engine,
                lambda text, finish_reason, usage=None: {"type": "delta", "text": text or ""},
                False,
                first=[{"type": "sources", "sources": sources}],
                final=lambda info: {"type": "done", "answer": info["text"].strip(), "stats": stats(info)},
            )
            return _EngineStream(events, engine, request)
        info = await non_stream(request, http_request)
        if isinstance(info, Response):
            return info
        return {"answer": info["text"].strip(), "sources": sources, "stats": stats(info), "model": cfg.model_name}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "rag_lookahead"}],
        }

    @app.get("/health")
    async def health():
        status = _health_status(engine)
        body = {
            "status": status,
            "model": cfg.model_name,
            "lookahead": engine.lookahead.enabled,
            "index": engine.index is not None,
            "queue_depth": engine.queue_depth,
            "batch_size": engine.batch_size,
            "max_batch_size": engine.max_batch_size,
        }
        if status == "error":
            body["error"] = "the generation engine is not running; the server log has the details"
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(engine.queue_depth, engine.batch_size, engine.active, engine.ready.is_set())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _health_status(engine: Engine) -> str:
    """ok | starting | draining | error (the engine failed to start or its thread died)."""
    if engine.error is not None or (engine.ready.is_set() and not engine.alive and not engine.draining):
        return "error"
    if engine.draining:
        return "draining"
    if not (engine.alive and engine.ready.is_set()):
        return "starting"
    return "ok"


# ---------------------------------------------------------------- running it


async def drain(engine: Engine, seconds: float) -> None:
    """Stop admitting; wait until the accepted requests are answered or ``seconds`` pass (then the
    engine fails the rest, and their handlers answer at once; uvicorn's own shutdown then waits
    for those responses to go out)."""
    engine.begin_drain(seconds)
    deadline = time.monotonic() + seconds + CLOSE_GRACE_SECONDS
    while engine.alive and not engine.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def make_server(app, engine: Engine, **uvicorn_options):
    """A ``uvicorn.Server`` for ``app`` whose shutdown (SIGTERM, SIGINT) first drains ``engine`` for
    its ``drain_seconds`` while new requests get 503, then closes the connections."""
    import uvicorn

    config = engine.config

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            log.info("shutting down: draining for up to %.0f s", config.drain_seconds)
            await drain(engine, config.drain_seconds)
            await super().shutdown(sockets)

    options = dict(
        host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=CLOSE_GRACE_SECONDS
    )
    options.update(uvicorn_options)
    return DrainingServer(uvicorn.Config(app, **options))


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="rag_lookahead serve",
        description="OpenAI-compatible server with continuous batching and lossless lookahead decoding.",
    )
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--model", default=d.model, help='"default" (embedded), a hub id or a local folder')
    p.add_argument("--served-model-name", default=None, help="model name reported in responses")
    p.add_argument("--dtype", default=None, help="bf16, fp32, fp16 or auto (default: bf16 where fast)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--device-map", default=None, help='accelerate device map, e.g. "auto" to spread the model over GPUs'
    )
    p.add_argument(
        "--index-dir", default=None, help="document index for /v1/rag (default: the default index, if built)"
    )
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests beyond the batch; more get 429")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--k-prompt", type=int, default=d.k_prompt, help="RAG passages shown to the model")
    p.add_argument("--k-seed", type=int, default=d.k_seed, help="RAG passages retrieved (the rest seed the trie)")
    p.add_argument("--max-stop", type=int, default=d.max_stop, help="most stop strings in a request")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="longest stop string")
    p.add_argument("--max-messages", type=int, default=d.max_messages, help="most chat messages in a request")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413 beyond)")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=d.drain_seconds,
        help="on SIGTERM, time for accepted requests to finish while new ones get 503",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (repeat for several keys; default ${API_KEY_ENV}, "
        "comma-separated; prefer the variable: flags are visible to other local users)",
    )
    p.add_argument(
        "--allowed-hosts",
        dest="allowed_hosts",
        action="append",
        default=None,
        metavar="HOST[,HOST]",
        help="Host names accepted besides the bound host and loopback ('*': any; needed behind a proxy or a DNS name)",
    )
    p.add_argument(
        "--output-pool",
        choices=OUTPUT_POOL_MODES,
        default=d.output_pool,
        help="shared: earlier answers speed up everyone (and stats can reveal them); per-key: one pool per API key; off",
    )
    p.add_argument("--no-lookahead", action="store_true", help="decode one token a forward (same text)")
    p.add_argument("--decoding-length", type=int, default=None, help="most draft nodes per forward")
    p.add_argument("--branch-length", type=int, default=None, help="deepest draft path")
    p.add_argument("--budget", choices=("auto", "fixed"), default=None)
    p.add_argument("--log-level", default=d.log_level, type=str.lower, choices=LOG_LEVELS)
    return p


def _split_commas(values: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def config_from_args(args: argparse.Namespace, environ: dict | None = None) -> ServerConfig:
    """The flags that share a ``ServerConfig`` field's name, plus the lookahead switches and the
    API keys (``--api-key``, else ``$RAG_LOOKAHEAD_API_KEY``)."""
    environ = os.environ if environ is None else environ
    flags = dict(vars(args))
    flags["api_keys"] = _split_commas(args.api_keys if args.api_keys else [environ.get(API_KEY_ENV, "")])
    flags["allowed_hosts"] = _split_commas(args.allowed_hosts)
    same = {f.name: flags[f.name] for f in fields(ServerConfig) if f.name in flags}
    changes = {
        k: v
        for k, v in (
            ("decoding_length", args.decoding_length),
            ("branch_length", args.branch_length),
            ("budget", args.budget),
        )
        if v is not None
    }
    return ServerConfig(
        **same,
        lookahead=not args.no_lookahead,
        lookahead_config=LookaheadConfig(**changes) if changes else None,
    )


def _warn_about_exposure(config: ServerConfig) -> None:
    if config.host in LOOPBACK:
        return
    if not config.api_keys:
        log.warning(
            "binding to %s without --api-key: anyone who can reach this address can use the server", config.host
        )
    if config.host in WILDCARD_BINDS and not config.allowed_hosts:
        log.warning(
            "binding to %s: only requests addressed to a loopback name are answered; "
            "pass --allowed-hosts with the names clients use",
            config.host,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _warn_about_exposure(config)
    app = create_app(config)
    make_server(app, app.state.engine).run()
    return 0


def run() -> None:
    """Console entry: ``python -m rag_lookahead.serve``; a bad setting is one line and exit 2."""
    try:
        raise SystemExit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    run()
