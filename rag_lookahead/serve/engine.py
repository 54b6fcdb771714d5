"""The engine: one thread that owns the model and decodes every request in continuous batches.

HTTP handlers (asyncio) tokenize a request in a worker thread, :meth:`Engine.submit` it into a
bounded waiting queue (full -> 429) and read its events (:mod:`rag_lookahead.serve.jobs`).
Between decode steps the engine thread

1. retires finished rows (EOS, max_tokens, a stop string seen, the client gone) at once,
2. admits waiting jobs up to the batch size (merged into the running batch of their output
   pool; with ``prefill_chunk`` their prompts are prefilled a chunk per step, else at once),
3. runs one propose -> verify -> accept step for every batch (carrying this step's prompt
   chunks) and pushes each row's new text.

A request is accepted only while the waiting queue has room (``max_queue``) and the tokens it
may hold fit the KV token budget (``max_batch_tokens``, :mod:`rag_lookahead.serve.admission`);
otherwise it gets 429 with a ``Retry-After`` header at once.

The batches themselves are :class:`~rag_lookahead.serve.batches.Batches`. If the thread dies,
every waiting client gets an error at once and ``/health`` says so.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.forward_signature import check_forward_signature
from rag_lookahead.decoding.inputs import context_limit, vocab_size
from rag_lookahead.serve.admission import TokenBudget, busy, default_token_budget
from rag_lookahead.serve.api_error import ApiError, engine_stopped, internal_error, shutting_down
from rag_lookahead.serve.batches import Batches
from rag_lookahead.serve.config import ServerConfig
from rag_lookahead.serve.fair_queue import FairQueue
from rag_lookahead.serve.jobs import Job, RequestOutcome
from rag_lookahead.serve.metrics import Metrics
from rag_lookahead.tokens import TextTracker, encode_messages, eos_ids, pad_id

__all__ = ["Engine"]

log = logging.getLogger(__name__)

ENGINE_THREAD = "rag-lookahead-engine"


class Engine:
    """Owns the model, the waiting queue and the engine thread."""

    def __init__(self, model, tokenizer, config: ServerConfig | None = None, index=None) -> None:
        self.config = config or ServerConfig()
        # said before the server starts (serve exits 1), not at the warm-up, which answered 503 to everything
        check_forward_signature(model)
        self.model = model
        self.tokenizer = tokenizer  # read only: its pad_token is left as the caller set it
        self.index = index
        self.lookahead = _lookahead_config(self.config, tokenizer)
        self.eos = frozenset(eos_ids(model, tokenizer))
        self.vocab_size = vocab_size(model)  # the ids DecodeBatch accepts: rows of the input embedding
        self.pad_id = pad_id(model, tokenizer, self.eos)
        if self.vocab_size and self.pad_id >= self.vocab_size:  # padding is masked, but must still embed
            self.pad_id = 0
        self.context_limit = context_limit(model)
        # the model's own generation config, checked before anyone asks (ConfigError), at the widest
        # prompt served: checked at width 1, a min_length of 5 stopped the start though every prompt
        # of 5 tokens reaches it; each request is checked at its own width (a shorter one: 400)
        self.sampling({}, self.widest_prompt)
        self._warn_if_sampling_refused()
        self.max_batch_size = self.config.max_batch_size
        self.ready = threading.Event()
        self.metrics = Metrics(
            queue_depth=lambda: self.queue_depth,
            batch_size=lambda: self.batch_size,
            active=lambda: self.active,
            ready=lambda: self.health == "ok",
        )
        self.batches = Batches(model, self.lookahead, self.eos, self.pad_id, self.config, self.metrics)
        self.token_budget = TokenBudget(self.config.max_batch_tokens or default_token_budget(model, self.config))
        # Encoding runs in handler threads, decoding in the engine thread. Plain encode and decode
        # only read the Rust tokenizer (no padding or truncation is ever set), so they may overlap;
        # encodes are serialised among themselves, decodes never wait for a long encode.
        self.tokenizer_lock = threading.Lock()
        self.retrieval_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting = FairQueue()  # by API key: the keys waiting take turns, round robin
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._drain_deadline = math.inf
        self.error: BaseException | None = None  # why the engine stopped (warm-up failed, the thread died)

    @classmethod
    def from_config(cls, config: ServerConfig) -> Engine:
        """Load the model (and the index, when there is one) named by ``config``.

        On a thread that ends with the loading: the torch thread team of a thread that computed
        (converting and packing the model, the embedder's calibration) lives as long as the
        thread, and a second team slowed every forward of the engine thread (``torch_threads``)."""
        from rag_lookahead.torch_threads import in_passing_thread

        return cls(**in_passing_thread(_load, config), config=config)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        if self._thread is None:
            self._stopping = self._draining = False
            self._drain_deadline = math.inf
            self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
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
    def health(self) -> str:
        """ok | starting | draining | error (the engine failed to start or its thread died): what
        /health says and the ready gauge shows (1 only for ok)."""
        if self.error is not None or (self.ready.is_set() and not self.alive and not self.draining):
            return "error"
        if self.draining:
            return "draining"
        if not (self.alive and self.ready.is_set()):
            return "starting"
        return "ok"

    @property
    def idle(self) -> bool:
        """Nothing waiting, being admitted or running. Under the lock: a job leaves the queue and
        is held for admission in one step."""
        with self._cond:  # reentrant (the engine thread asks while holding it)
            return not self._waiting and not self.batches.busy

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return self.batches.size

    @property
    def active(self) -> int:
        return self.batches.jobs

    # ------------------------------------------------------------ tokenizing, retrieval (handler side, worker threads)

    def encode_text(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer(text, verbose=False)["input_ids"])  # a long one: refused in our words

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        answer_prefix: str = "",
        template_variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Messages through the chat template, as :class:`LookaheadLLM` encodes its prompts (see
        :func:`rag_lookahead.tokens.encode_messages` for the options)."""
        with self.tokenizer_lock:
            return encode_messages(
                self.tokenizer,
                messages,
                tools=tools or None,
                answer_prefix=answer_prefix,
                template_variables=template_variables,
            )

    def encode_passages(self, passages: Sequence[str]) -> list[list[int]]:
        with self.tokenizer_lock:
            return [self.tokenizer.encode(p, add_special_tokens=False, verbose=False) for p in passages if p]

    def retrieve(self, question: str, k: int):
        """The ``k`` passages nearest ``question`` in the index, as LangChain documents."""
        with self.retrieval_lock:
            passages = self.index.search(question, k)
        return [p.to_document() for p in passages]

    # ------------------------------------------------------------ the queue (handler side)

    def sampling(self, options: dict, prompt_width: int):
        """The core's :class:`~rag_lookahead.decoding.sampling.SamplingParams` for a request's sampling
        ``options`` (``GenerationRequest.sampling_options``; ``{}``: greedy), over the model's generation
        config as ``model.generate`` reads it: a Qwen2.5-Instruct model's ``repetition_penalty``
        1.05 and ``top_k`` 20 hold here as in the other entry points (the server ignored them, and
        sampled with no top-k where they drew from 50). A setting we do not implement is a ConfigError."""
        from rag_lookahead.decoding.sampling import resolve_sampling

        options = {"do_sample": False} | options
        return resolve_sampling(self.model, prompt_width=prompt_width, has_eos=bool(self.eos), **options)

    @property
    def widest_prompt(self) -> int:
        """The most tokens a prompt may hold here: ``max_prompt_tokens``, and short of the model's
        context (``limits.checked_prompt`` refuses the rest)."""
        if self.context_limit is None:
            return self.config.max_prompt_tokens
        return max(1, min(self.config.max_prompt_tokens, self.context_limit - 1))

    def _warn_if_sampling_refused(self) -> None:
        """A setting of the model's config that applies only when sampling (``typical_p``) and that we
        do not implement leaves greedy requests served and sampled ones answered 400: said at start,
        once, rather than only to each client, who cannot change it."""
        from rag_lookahead.errors import ConfigError

        try:
            self.sampling({"do_sample": True, "temperature": 1.0}, self.widest_prompt)
        except ConfigError as e:
            log.warning("sampled requests will be refused (greedy ones are served): %s", e)

    def new_request(
        self, prompt_ids: list[int], max_tokens: int, stop: list[str], references=(), pool_key: str = "", sampling=None
    ) -> Job:
        """``sampling``: a :class:`rag_lookahead.decoding.sampling.SamplingParams` (default greedy); rows with
        different settings share one batch, and a seeded row's text does not depend on the batch."""
        tracker = TextTracker(self.tokenizer, stop, self.eos)
        key = pool_key if self.config.output_pool == "per-key" else ""
        references = [list(r) for r in references]
        return Job(list(prompt_ids), max_tokens, list(stop), references, tracker, key, sampling, owner=pool_key)

    def _refusal(self, jobs: Sequence[Job] = (), choices: int | None = None) -> ApiError | None:
        """Why a new request cannot be taken now (call with ``_cond`` held). With its ``jobs``: every
        check. With only its ``choices`` (once its body is read, before it is tokenized): the queue's,
        a count that never fits a 400; the KV budget is left to ``submit``, which knows what the
        request needs (a 400 when more than the whole budget, whatever the budget holds; while the
        queue is full such a request gets the queue's 429 here first, untokenized). With
        neither (before its body is read): whether there is room for anything, naming no count."""
        if self.error is not None or (self._thread is not None and not self._thread.is_alive()):
            return engine_stopped()
        if self._stopping or self._draining:
            return shutting_down()
        rate, limit = self.batches.tokens_per_second, self.config.max_queue
        choices = len(jobs) or choices
        per_key = self.config.max_queue_per_key if jobs else None
        too_many = self._never_queued(choices) if choices else None
        if too_many is not None:  # never fits: a 400, not a 429 to retry forever (before the queue's state)
            return too_many
        too_large = self.token_budget.never_fits(jobs)
        if too_large is not None:
            return too_large
        if len(self._waiting) + (choices or 1) > limit:  # the queue holds choices: an n-choice request takes n places
            wait = self.token_budget.retry_after(self.token_budget.need_of(jobs) if jobs else 1, rate)
            this = f" and this request has {choices}" if choices else ""
            return busy(
                f"the server is busy: {len(self._waiting)} choices are already waiting{this} "
                f"(max_queue={limit}); retry after {wait} s",
                wait,
            )
        if per_key is not None:
            waiting = self._waiting.waiting_of(jobs[0].owner)
            if waiting + choices > per_key:
                wait = self.token_budget.retry_after(self.token_budget.need_of(jobs), rate)
                return busy(
                    f"this API key already has {waiting} choices waiting and this request has {choices} "
                    f"(max_queue_per_key={per_key}); retry after {wait} s",
                    wait,
                )
        if not jobs and choices:  # the KV budget: judged by submit, once the request is tokenized
            return None
        return self.token_budget.refusal(jobs, rate)

    def _never_queued(self, choices: int) -> ApiError | None:
        """The 400 for a request of more ``choices`` than the queue (or one key's share) ever holds."""
        for cap, name in ((self.config.max_queue, "max_queue"), (self.config.max_queue_per_key, "max_queue_per_key")):
            if cap is not None and choices > cap:
                return ApiError(
                    400,
                    f"this request's {choices} choices (n for each prompt) can never all wait in the queue "
                    f"({name}={cap}); lower n or send fewer prompts",
                    param="n",
                    code="request_too_large",
                )
        return None

    def check_capacity(self, choices: int | None = None) -> None:
        """Raise the 503, 429 or 400 that ``submit`` would, before a handler spends work on a request:
        before its body is read (``choices`` None: 429 only when there is no room at all), then once
        its ``choices`` (prompts x n) are known, before it is tokenized (3,523 short prompts were
        tokenized, 2.4 s under the tokenizer lock, to be refused for a count known from the body)."""
        with self._cond:
            refusal = self._refusal(choices=choices)
        if refusal is not None:
            raise refusal

    def submit(self, *jobs: Job) -> None:
        """Queue a request's ``jobs`` (its ``n`` choices) all together, or none of them and raise why:
        503 (stopping), 429 with ``Retry-After`` (the queue or the KV token budget is full), 400 (they
        need more tokens than the whole budget). A choice never runs while its siblings were refused."""
        with self._cond:
            refusal = self._refusal(jobs)
            if refusal is not None:
                raise refusal
            outcome = RequestOutcome(len(jobs))
            for job in jobs:
                job.outcome = outcome
                self.token_budget.hold(job)
                self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client left: drop the job from the queue, or from its batch at the next step."""
        with self._cond:
            if job.cancelled or job.finished or job.ended:
                return
            job.cancelled = True
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # in a batch (or being admitted): the engine retires it and counts it
            self.metrics.settle(job, "cancelled")  # inside the lock: whoever sees the queue shorter sees it counted

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        """The engine thread. Whatever ends it, every job still waiting gets an error at once."""
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
            internal_error(503, "the generation engine stopped", e)
        finally:
            with self._cond:
                self._stopping = True
            self._fail_everything(shutting_down() if clean and self.error is None else engine_stopped())

    def _warm_up(self) -> bool:
        """Measure the tree-mask probe and the cost curve, and build a lazy output-layer screen,
        once, not inside a request's latency."""
        try:
            self.batches.new_batch()
            from rag_lookahead.decoding.verify import supports_tree_mask
            from rag_lookahead.greedy_head import greedy_head_of

            greedy_head_of(self.model)

            # rows share one packed cache kept apart by the mask, drafting or not
            if self.max_batch_size > 1 and not supports_tree_mask(self.model):
                log.warning("this model ignores custom attention masks: decoding one request at a time")
                self.max_batch_size = 1
        except Exception as e:  # noqa: BLE001 - reported by /health and to every request
            self.error = e
            internal_error(503, "engine warm-up failed", e)
            return False
        self.ready.set()
        return True

    def _serve_once(self) -> bool:
        """One round: retire, admit, step. False once the engine is stopping."""
        admitted: list[Job] | None = []
        try:
            self.batches.retire_all()
            admitted = self._take_waiting()
            if admitted is None:
                return False
            if admitted:
                self.batches.admit(admitted)
                self.batches.retire_all()
            self.batches.step_all()
        except Exception as e:  # noqa: BLE001 - a bug between the guarded parts: fail what runs, carry on
            running = self.batches.drop_all()
            self.batches.fail(running + list(admitted or ()), self.batches.failure(e))
        return True

    def _take_waiting(self) -> list[Job] | None:
        """Wait for work; return the jobs to admit ([] when only stepping), None when stopping."""
        with self._cond:
            while not self._stopping:
                expired = self._draining and time.monotonic() >= self._drain_deadline
                if expired and not self.idle:
                    break
                if not expired and (self._waiting or self.batch_size):
                    taken = self._waiting.take(self.max_batch_size - self.batch_size)
                    self.batches.hold(taken)  # active from the queue on: no moment where they are in neither
                    return taken
                until_deadline = self._drain_deadline - time.monotonic()
                self._cond.wait(timeout=min(1.0, until_deadline) if until_deadline > 0 else 1.0)
            else:
                return None
        self._fail_everything(shutting_down())  # the drain time is over: what is left gets an error
        return []

    def _fail_everything(self, error: ApiError) -> None:
        """Every running and waiting job gets ``error`` (shutdown, drain over, the engine died)."""
        with self._cond:
            waiting = self._waiting.clear()
        self.batches.fail(self.batches.drop_all() + waiting, error)


def _lookahead_config(config: ServerConfig, tokenizer) -> LookaheadConfig:
    """The drafter settings: the config's (or the defaults), stop words from the tokenizer, off
    with ``lookahead=False``."""
    lookahead = config.lookahead_config or LookaheadConfig()
    if not lookahead.stop_words:
        lookahead = lookahead.with_tokenizer(tokenizer)
    if not config.lookahead:
        lookahead = lookahead.replace(enabled=False)
    return lookahead


def _load(config: ServerConfig) -> dict:
    """The model, its tokenizer and the index ``config`` names (the default index if it loads).
    The index first, as ``ask`` opens it: a mistyped ``--index-dir`` was said after the model had
    loaded (23 s and 4 GB for the default model; minutes for a large one)."""
    from rag_lookahead.models import load_model
    from rag_lookahead.rag.index import default_index_dir, load_index

    index = None
    if config.index_dir is not None:
        index = load_index(config.index_dir)  # asked for explicitly: fail loudly
    elif default_index_dir().is_dir():
        try:
            index = load_index(default_index_dir())
        except Exception as e:  # the default is optional: serve without RAG
            log.warning("default index at %s not loaded (%s); /v1/rag will answer 503", default_index_dir(), e)
    model, tokenizer = load_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        device_map=config.device_map,
        trust_remote_code=config.trust_remote_code,
    )
    return {"model": model, "tokenizer": tokenizer, "index": index.warm() if index is not None else None}
