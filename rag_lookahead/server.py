"""OpenAI-compatible HTTP server with continuous batching over the lossless lookahead loop.

    rag_lookahead serve --port 8000 --index-dir ~/my_index
    curl -N 127.0.0.1:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"hi"}],"stream":true}'

One engine thread owns the model and a :class:`rag_lookahead.generate.DecodeBatch`. HTTP handlers
(asyncio, uvicorn) validate and tokenize a request, put it into a bounded waiting queue (full ->
429) and read the request's events from an ``asyncio.Queue`` that the engine feeds with
``loop.call_soon_threadsafe``. Between decode steps the engine

1. retires finished rows (EOS, max_tokens, a stop string seen, the client gone) at once,
2. admits waiting requests up to the batch size (one prefill for all of them, merged into the
   running batch),
3. runs one propose -> verify -> accept step for every row and pushes each row's new text.

Decoding is greedy: a request's text is exactly what a single-request ``generate`` gives for the
same prompt, whatever else is in the batch. ``temperature`` > 0 (and other sampling knobs) are
refused with 400 rather than silently ignored.

Endpoints: ``POST /v1/completions`` (raw prompt, no chat template; a string or a list of token
ids), ``POST /v1/chat/completions`` (messages through the tokenizer's chat template), both with
``stream`` (server-sent events in OpenAI's chunk shapes, ``data: [DONE]``); ``POST /v1/rag``
(retrieve from the loaded index, seed the trie with the passages left out of the prompt);
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, Sequence

from fastapi import Request  # module level: FastAPI resolves the handlers' string annotations here

from .config import LookaheadConfig
from .errors import ConfigError

__all__ = ["ServerConfig", "Engine", "ApiError", "create_app", "main"]

log = logging.getLogger("rag_lookahead.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ---------------------------------------------------------------- configuration


@dataclass
class ServerConfig:
    """Every knob of the server; the ``serve`` flags mirror these names.

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
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"
    served_model_name: str | None = None
    dtype: str | None = None
    device: str | None = None
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
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue", "max_prompt_tokens", "max_tokens_limit", "default_max_tokens", "k_prompt", "max_stop"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.k_seed, int) or self.k_seed < self.k_prompt:
            raise ConfigError(f"k_seed must be an integer >= k_prompt ({self.k_prompt}), got {self.k_seed!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port must be an integer in 0..65535, got {self.port!r}")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "qwen2.5-coder-0.5b-instruct" if self.model == "default" else str(self.model)


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


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
            metric("rag_lookahead_tokens_generated_total", "counter", "Tokens generated over all requests.", [("", self.tokens_generated)])
            metric("rag_lookahead_forward_passes_total", "counter", "Batched decode forwards (after prefills).", [("", self.forward_passes)])
            metric("rag_lookahead_prefills_total", "counter", "Prefill forwards (each admits one or more requests).", [("", self.prefills)])
            metric("rag_lookahead_row_steps_total", "counter", "Decode steps summed over rows.", [("", self.row_steps)])
            metric("rag_lookahead_mean_accepted_tokens", "gauge", "Tokens gained per row and decode forward (1.0 = plain decoding).", [("", mean)])
            metric("rag_lookahead_requests_completed_total", "counter", "Generation requests answered in full.", [("", self.completed)])
            metric("rag_lookahead_requests_cancelled_total", "counter", "Generation requests dropped because the client left.", [("", self.cancelled)])
            metric("rag_lookahead_engine_errors_total", "counter", "Engine steps that failed (their requests got an error).", [("", self.engine_errors)])
            metric("rag_lookahead_prefill_seconds_total", "counter", "Seconds spent in prefills.", [("", self.prefill_seconds)])
            metric("rag_lookahead_decode_seconds_total", "counter", "Seconds spent in decode steps.", [("", self.decode_seconds)])
        metric("rag_lookahead_queue_depth", "gauge", "Requests waiting for a batch slot.", [("", queue_depth)])
        metric("rag_lookahead_batch_size", "gauge", "Rows in the running batch.", [("", batch_size)])
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
    """One generation request: tokens in, text events out through ``channel``."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, stop: list[str], references: list[list[int]], tracker) -> None:
        self.id = uuid.uuid4().hex
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stop = stop
        self.references = references
        self.tracker = tracker
        self.loop = asyncio.get_running_loop()
        self.channel: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.finished = False  # the handler saw the last event
        self.steps = 0  # blocks accepted (the prefill's first token is one)
        self.submitted = time.perf_counter()

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.channel.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Engine:
    """The engine thread: owns the model and the running :class:`DecodeBatch`."""

    def __init__(self, model, tokenizer, config: ServerConfig | None = None, index=None) -> None:
        from .llm import _eos_ids
        from .trie import OutputPool

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
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos = frozenset(_eos_ids(model, tokenizer))
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self.pad_id = int(tokenizer.pad_token_id)
        if self.vocab_size and self.pad_id >= self.vocab_size:  # padding is masked, but must still embed
            self.pad_id = 0
        self.context_limit = getattr(model.config, "max_position_embeddings", None)
        self.output_pool = OutputPool(lookahead.branch_length + lookahead.max_key_length, lookahead.output_pool_nodes)
        self.max_batch_size = self.config.max_batch_size
        self.metrics = Metrics()
        self.ready = threading.Event()
        self.tokenizer_lock = threading.Lock()  # encode in handlers, decode in the engine
        self.retrieval_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[str, _Request] = {}
        self._batch = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set when warm-up failed

    @classmethod
    def from_config(cls, config: ServerConfig) -> "Engine":
        """Load the model (and the index, when there is one) named by ``config``."""
        from .index import default_index_dir, load_index
        from .models import load_model

        model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
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

    def start(self) -> "Engine":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="rag-lookahead-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
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
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        batch = self._batch
        return len(batch.rows) if batch is not None else 0

    @property
    def active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------ tokenizing (handler side)

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

    def new_request(self, prompt_ids: list[int], max_tokens: int, stop: list[str], references=()) -> _Request:
        from .llm import _TextTracker

        return _Request(list(prompt_ids), max_tokens, list(stop), [list(r) for r in references], _TextTracker(self.tokenizer, stop, self.eos))

    # ------------------------------------------------------------ queue (handler side)

    def submit(self, request: _Request) -> None:
        with self._cond:
            if self._stopping or (self._thread is not None and not self._thread.is_alive()):
                raise ApiError(503, "the server is shutting down or its engine has stopped", "server_error")
            if len(self._waiting) >= self.config.max_queue:
                raise ApiError(
                    429,
                    f"the server is busy: {len(self._waiting)} requests are already waiting (max_queue={self.config.max_queue}); retry later",
                    "rate_limit_error",
                )
            self._waiting.append(request)
            self._cond.notify_all()

    def cancel(self, request: _Request) -> None:
        """The client left: drop the request from the queue, or from the batch at the next step."""
        with self._cond:
            if request.cancelled or request.finished:
                return
            request.cancelled = True
            try:
                self._waiting.remove(request)
            except ValueError:
                return  # in the batch (or being admitted): the engine retires it
        self.metrics.add(cancelled=1)

    # ------------------------------------------------------------ the engine thread

    def _new_batch(self):
        from .generate import DecodeBatch

        return DecodeBatch(self.model, self.lookahead, self.eos, self.output_pool)

    def _run(self) -> None:
        import torch

        try:
            # warm up: the tree-mask probe and the cost curve are measured once per model here,
            # not inside the first request's latency
            self._new_batch()
            from .verify import supports_tree_mask

            # rows share one packed cache kept apart by the mask, drafting or not
            if self.max_batch_size > 1 and not supports_tree_mask(self.model):
                log.warning("this model ignores custom attention masks: decoding one request at a time")
                self.max_batch_size = 1
        except BaseException as e:  # noqa: BLE001 - reported by /health and to every request
            log.exception("engine warm-up failed")
            self.error = e
            self._fail_all(f"the engine failed to start: {e}")
            return
        self.ready.set()
        with torch.inference_mode():
            while True:
                self._retire()
                with self._cond:
                    while not self._stopping and not self._waiting and self.batch_size == 0:
                        self._cond.wait(timeout=1.0)
                    if self._stopping:
                        break
                    room = self.max_batch_size - self.batch_size
                    admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                try:
                    if admitted:
                        self._admit(admitted)
                        self._retire()
                    if self.batch_size:
                        self._step()
                except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                    log.exception("engine step failed")
                    self.metrics.add(engine_errors=1)
                    self._fail_active(f"generation failed: {type(e).__name__}: {e}", admitted)
        self._fail_all("the server is shutting down")

    def _admit(self, requests: list[_Request]) -> None:
        """One prefill for all admitted requests, merged into the running batch."""
        from .generate import left_pad

        dropped = sum(1 for r in requests if r.cancelled)
        if dropped:  # cancelled between leaving the queue and the prefill
            self.metrics.add(cancelled=dropped)
        requests = [r for r in requests if not r.cancelled]
        if not requests:
            return
        if self._batch is None or not self._batch.rows:
            self._batch = self._new_batch()
        device = next(self.model.parameters()).device
        ids, mask = left_pad([r.prompt_ids for r in requests], self.pad_id, device)
        references = [r.references for r in requests] if any(r.references for r in requests) else None
        for r in requests:
            self._active[r.id] = r
        start = time.perf_counter()
        rows = self._batch.add(ids, mask, references, [r.max_tokens for r in requests], keys=[r.id for r in requests])
        self.metrics.add(prefills=1, prefill_seconds=time.perf_counter() - start)
        for request, row in zip(requests, rows):
            self._deliver(request, row.generated)

    def _step(self) -> None:
        batch = self._batch
        start = time.perf_counter()
        drafts = batch.propose()
        gained = batch.verify_and_accept(drafts)
        tokens = sum(len(g) for g in gained)
        self.metrics.add(
            forward_passes=1, row_steps=len(gained), step_tokens=tokens, decode_seconds=time.perf_counter() - start
        )
        for row, new in zip(batch.rows, gained):
            self._deliver(self._active[row.index], new)

    def _deliver(self, request: _Request, tokens: list[int]) -> None:
        if not tokens:
            return
        request.steps += 1
        self.metrics.add(tokens_generated=len(tokens))
        with self.tokenizer_lock:
            piece = request.tracker.add(tokens)
        if piece and not request.cancelled:
            request.emit(("piece", piece))

    def _retire(self) -> None:
        """Remove finished, stopped and cancelled rows from the batch; send the last event."""
        batch = self._batch
        if batch is None:
            return
        if batch.rows:

            def keep(row) -> bool:
                request = self._active.get(row.index)
                return request is not None and not request.cancelled and not request.tracker.stopped

            for row in batch.finish(keep):
                request = self._active.pop(row.index, None)
                if request is None:
                    continue
                if request.cancelled:
                    self.metrics.add(cancelled=1)
                    continue
                with self.tokenizer_lock:
                    rest = request.tracker.rest()
                    text = request.tracker.final_text()
                tracker = request.tracker
                stopped = tracker.stopped or bool(row.generated and row.generated[-1] in self.eos)
                decode_steps = max(request.steps - 1, 0)
                info = {
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
                self.metrics.add(completed=1)
                request.emit(("done", info))
        if not batch.rows:
            self._batch = None  # frees the KV cache; the next admission starts a fresh batch

    def _fail_active(self, message: str, admitted: Sequence[_Request] = ()) -> None:
        seen = set()
        for request in list(self._active.values()) + list(admitted):
            if request.id in seen:
                continue
            seen.add(request.id)
            request.emit(("error", ApiError(500, message, "server_error")))
        self._active.clear()
        self._batch = None

    def _fail_all(self, message: str) -> None:
        self._fail_active(message)
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request in waiting:
            request.emit(("error", ApiError(503, message, "server_error")))

    # ------------------------------------------------------------ retrieval (handler side, in a worker thread)

    def retrieve(self, question: str, k: int):
        from langchain_core.documents import Document

        with self.retrieval_lock:
            passages = self.index.search(question, k)
        return [Document(page_content=p.text, metadata={"source": p.source, "chunk_id": p.chunk_id, "score": p.score}) for p in passages]


# ---------------------------------------------------------------- request validation


def _get_int(body: dict, name: str, default: int | None, low: int, high: int | None, hint: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)}", param=name)
    if value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ApiError(400, f"'{name}' must be {span}{hint}, got {value}", param=name)
    return value


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(value)}", param=name)
    return value


@dataclass
class _Params:
    model: str
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool


def _common_params(body: dict, engine: Engine, max_tokens_names: Sequence[str] = ("max_tokens",)) -> _Params:
    cfg = engine.config
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    _get_int(body, "n", 1, 1, 1, " (this server returns one choice per request)")
    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise ApiError(400, "'temperature' must be a number", param="temperature")
        if temperature != 0:
            raise ApiError(
                400,
                f"this server decodes greedily only (lossless lookahead): 'temperature' must be 0 or absent, got {temperature}",
                param="temperature",
            )
    top_p = body.get("top_p")
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise ApiError(400, f"'top_p' must be a number in (0, 1], got {json.dumps(top_p)}", param="top_p")
        if top_p != 1 and temperature != 0:  # with temperature 0 decoding is greedy whatever top_p says
            raise ApiError(400, f"this server decodes greedily only: 'top_p' must be 1 or absent, got {top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise ApiError(400, f"'{name}' is not supported (greedy decoding only): leave it out or set it to 0", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "'logprobs' is not supported by this server", param="logprobs")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", param="suffix")
    _get_int(body, "best_of", 1, 1, 1, " (greedy decoding has one best)")
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _get_int(body, name, None, 1, cfg.max_tokens_limit, f" (the server's max_tokens limit is {cfg.max_tokens_limit})")
        if max_tokens is not None:
            break
    if max_tokens is None:
        max_tokens = min(cfg.default_max_tokens, cfg.max_tokens_limit)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    stop = [s for s in stop if s]
    if len(stop) > cfg.max_stop:
        raise ApiError(400, f"'stop' has {len(stop)} strings; at most {cfg.max_stop} are allowed", param="stop")
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return _Params(model or cfg.model_name, max_tokens, stop, stream, include_usage)


def _check_prompt(ids: list[int], engine: Engine) -> list[int]:
    cfg = engine.config
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) > cfg.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {cfg.max_prompt_tokens} (max_prompt_tokens)", param="prompt")
    if engine.context_limit is not None and len(ids) >= engine.context_limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context holds {engine.context_limit}", param="prompt")
    if engine.vocab_size and any(t >= engine.vocab_size for t in ids):
        raise ApiError(400, f"the prompt holds token ids outside the model's vocabulary (size {engine.vocab_size})", param="prompt")
    return ids


def _completion_prompt(body: dict, engine: Engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return _check_prompt(engine.encode_text(prompt), engine)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise ApiError(400, "token ids in 'prompt' must be >= 0", param="prompt")
        return _check_prompt(list(prompt), engine)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "'prompt' holds several prompts: send one prompt per request", param="prompt")
    raise ApiError(400, "'prompt' is required: a string or a list of token ids", param="prompt")


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {json.dumps(role)}", param="messages")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI content parts: text only
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}} (text only)", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise ApiError(400, "every message is empty", param="messages")
    return out


# ---------------------------------------------------------------- responses


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


async def _next_event(request: _Request, http_request, engine: Engine, poll: float = 0.25) -> tuple:
    """The request's next event; cancels it when the client has gone (non-streaming waits)."""
    while True:
        try:
            return await asyncio.wait_for(request.channel.get(), poll)
        except asyncio.TimeoutError:
            if http_request is not None and await http_request.is_disconnected():
                engine.cancel(request)
                raise _ClientGone() from None


class _ClientGone(Exception):
    pass


async def _collect(request: _Request, http_request, engine: Engine) -> dict:
    """Wait for the whole answer; returns the engine's final info."""
    try:
        while True:
            event = await _next_event(request, http_request, engine)
            if event[0] == "done":
                request.finished = True
                return event[1]
            if event[0] == "error":
                request.finished = True
                raise event[1]
    finally:
        if not request.finished:
            engine.cancel(request)


def _usage(info: dict) -> dict:
    return {
        "prompt_tokens": info["prompt_tokens"],
        "completion_tokens": info["completion_tokens"],
        "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
    }


def _stats(info: dict) -> dict:
    return {k: info[k] for k in ("forward_passes", "mean_accepted", "seconds", "lookahead")}


async def _stream(request: _Request, engine: Engine, make_chunk, include_usage: bool, first: list | None = None, final=None):
    """Server-sent events: ``make_chunk(text, finish_reason)`` shapes each one."""
    try:
        for payload in first or ():
            yield _sse(payload)
        while True:
            event = await request.channel.get()
            kind = event[0]
            if kind == "piece":
                yield _sse(make_chunk(event[1], None))
            elif kind == "done":
                request.finished = True
                info = event[1]
                if info["rest"]:
                    yield _sse(make_chunk(info["rest"], None))
                if final is not None:
                    yield _sse(final(info))
                else:
                    yield _sse(make_chunk(None, info["finish_reason"]))
                    if include_usage:
                        yield _sse(make_chunk(None, None, usage=_usage(info)))
                yield _DONE
                return
            else:
                request.finished = True
                yield _sse(event[1].body())
                yield _DONE
                return
    finally:  # the client left (the generator was cancelled or closed) or we are done
        if not request.finished:
            engine.cancel(request)


# ---------------------------------------------------------------- the app


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


def create_app(engine_or_config: Engine | ServerConfig | None = None):
    """The FastAPI app. Given a config it loads the model; the engine thread starts with the app
    (lifespan) and stops with it."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
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
            await run_in_threadpool(engine.stop)

    app = FastAPI(title="rag_lookahead", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.add_middleware(_CountRequests, metrics=engine.metrics)
    ids = itertools.count()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(err.status_code, str(err.detail), kind).body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(ApiError(400, f"invalid request: {err.errors()}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}: {err}", "server_error").body(), status_code=500)

    async def json_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def make_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(ids)}"

    async def submit(request: _Request) -> None:
        if not engine.ready.is_set() and engine.error is not None:
            raise ApiError(503, f"the engine failed to start: {engine.error}", "server_error")
        engine.submit(request)

    async def non_stream(request: _Request, http_request: Request) -> dict | Response:
        try:
            return await _collect(request, http_request, engine)
        except _ClientGone:
            return Response(status_code=499)

    def stream_response(generator) -> StreamingResponse:
        return StreamingResponse(generator, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await json_body(http_request)
        params = _common_params(body, engine)
        prompt = _completion_prompt(body, engine)
        request = engine.new_request(prompt, params.max_tokens, params.stop)
        await submit(request)
        rid, created = make_id("cmpl"), int(time.time())

        def chunk(text: str | None, finish_reason: str | None, usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": params.model}
            out["choices"] = [] if usage else [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}]
            if usage:
                out["usage"] = usage
            return out

        if params.stream:
            return stream_response(_stream(request, engine, chunk, params.include_usage))
        info = await non_stream(request, http_request)
        if isinstance(info, Response):
            return info
        out = chunk(info["text"], info["finish_reason"])
        out["usage"] = _usage(info)
        out["stats"] = _stats(info)
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await json_body(http_request)
        params = _common_params(body, engine, ("max_completion_tokens", "max_tokens"))
        if body.get("tools") or body.get("functions"):
            raise ApiError(400, "tool and function calling are not supported by this server", param="tools")
        messages = _chat_messages(body)
        try:
            prompt = engine.encode_chat(messages)
        except Exception as e:  # a template that refuses this conversation (e.g. role order)
            raise ApiError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        request = engine.new_request(_check_prompt(prompt, engine), params.max_tokens, params.stop)
        await submit(request)
        rid, created = make_id("chatcmpl"), int(time.time())

        def chunk(text: str | None, finish_reason: str | None, usage: dict | None = None, first: bool = False) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": params.model, "system_fingerprint": None}
            if usage:
                out["choices"], out["usage"] = [], usage
                return out
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
            return out

        if params.stream:
            return stream_response(_stream(request, engine, chunk, params.include_usage, first=[chunk(None, None, first=True)]))
        info = await non_stream(request, http_request)
        if isinstance(info, Response):
            return info
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": params.model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": info["text"]}, "logprobs": None, "finish_reason": info["finish_reason"]}
            ],
            "usage": _usage(info),
            "stats": _stats(info),
        }

    @app.post("/v1/rag")
    async def rag(http_request: Request):
        from .chains import make_prompt, source_info

        body = await json_body(http_request)
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ApiError(400, "'question' is required: a non-empty string", param="question")
        k = _get_int(body, "k", cfg.k_prompt, 1, 32, " (passages shown to the model)")
        max_tokens = _get_int(body, "max_tokens", min(cfg.default_max_tokens, cfg.max_tokens_limit), 1, cfg.max_tokens_limit,
                              f" (the server's max_tokens limit is {cfg.max_tokens_limit})")
        stream = _get_bool(body, "stream")
        if engine.index is None:
            raise ApiError(
                503,
                "no document index is loaded: build one with `rag_lookahead index CORPUS_DIR --index-dir DIR` "
                "and start the server with `--index-dir DIR`",
                "server_error",
            )
        k_seed = max(cfg.k_seed, k)
        start = time.perf_counter()
        docs = await run_in_threadpool(engine.retrieve, question, k_seed)
        retrieval_seconds = time.perf_counter() - start
        shown, seeds = docs[:k], docs[k:]
        prompt = engine.encode_chat([{"role": "user", "content": make_prompt(question, shown)}])
        references = engine.encode_passages([d.page_content for d in seeds]) if engine.lookahead.enabled else []
        request = engine.new_request(_check_prompt(prompt, engine), max_tokens, [], references)
        await submit(request)
        sources = [source_info(d, i < k) for i, d in enumerate(docs)]

        def stats(info: dict) -> dict:
            return {**_stats(info), "retrieval_seconds": round(retrieval_seconds, 4), "seed_passages": len(seeds),
                    "finish_reason": info["finish_reason"], "usage": _usage(info)}

        if stream:
            return stream_response(
                _stream(
                    request,
                    engine,
                    lambda text, finish_reason, usage=None: {"type": "delta", "text": text or ""},
                    False,
                    first=[{"type": "sources", "sources": sources}],
                    final=lambda info: {"type": "done", "answer": info["text"].strip(), "stats": stats(info)},
                )
            )
        info = await non_stream(request, http_request)
        if isinstance(info, Response):
            return info
        return {"answer": info["text"].strip(), "sources": sources, "stats": stats(info), "model": cfg.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "rag_lookahead"}]}

    @app.get("/health")
    async def health():
        ok = engine.alive and engine.ready.is_set()
        body = {
            "status": "ok" if ok else ("error" if engine.error or (engine.ready.is_set() and not engine.alive) else "starting"),
            "model": cfg.model_name,
            "lookahead": engine.lookahead.enabled,
            "index": engine.index is not None,
            "queue_depth": engine.queue_depth,
            "batch_size": engine.batch_size,
            "max_batch_size": engine.max_batch_size,
        }
        if engine.error is not None:
            body["error"] = str(engine.error)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(engine.queue_depth, engine.batch_size, engine.active, engine.ready.is_set())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="rag_lookahead serve", description="OpenAI-compatible server with continuous batching and lossless lookahead decoding.")
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--model", default=d.model, help='"default" (embedded), a hub id or a local folder')
    p.add_argument("--served-model-name", default=None, help="model name reported in responses")
    p.add_argument("--dtype", default=None, help="bf16, fp32, fp16 or auto (default: bf16 where fast)")
    p.add_argument("--device", default=None)
    p.add_argument("--index-dir", default=None, help="document index for /v1/rag (default: the default index, if built)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests beyond the batch; more get 429")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--k-prompt", type=int, default=d.k_prompt, help="RAG passages shown to the model")
    p.add_argument("--k-seed", type=int, default=d.k_seed, help="RAG passages retrieved (the rest seed the trie)")
    p.add_argument("--no-lookahead", action="store_true", help="decode one token a forward (same text)")
    p.add_argument("--decoding-length", type=int, default=None, help="most draft nodes per forward")
    p.add_argument("--branch-length", type=int, default=None, help="deepest draft path")
    p.add_argument("--budget", choices=("auto", "fixed"), default=None)
    p.add_argument("--log-level", default=d.log_level)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The flags that share a ``ServerConfig`` field's name, plus the lookahead switches."""
    flags = vars(args)
    same = {f.name: flags[f.name] for f in fields(ServerConfig) if f.name in flags}
    changes = {k: v for k, v in (("decoding_length", args.decoding_length), ("branch_length", args.branch_length), ("budget", args.budget)) if v is not None}
    return ServerConfig(
        **same,
        lookahead=not args.no_lookahead,
        lookahead_config=LookaheadConfig(**changes) if changes else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.host not in LOOPBACK:
        log.warning("binding to %s: the server has no authentication; anyone who can reach this address can use it", config.host)
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
