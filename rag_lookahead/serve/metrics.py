"""``GET /metrics``: the server's counters and gauges in Prometheus text format (prometheus-client).

Each app has its own :class:`~prometheus_client.CollectorRegistry`, so two servers in one process
(tests do that) count apart. The engine thread and the event loop write; a scrape reads. Gauges
of the engine's state (queue, batch, ready) are read from it at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

#: The text format ``generate_latest`` writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The paths counted by name in ``rag_lookahead_requests_total``; any other is "other".
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/rag", "/v1/models", "/health", "/metrics")


class Metrics:
    """The counters of one server; the callables say the engine's state at each scrape."""

    def __init__(
        self,
        *,
        queue_depth: Callable[[], float],
        batch_size: Callable[[], float],
        active: Callable[[], float],
        ready: Callable[[], bool],
    ) -> None:
        # a `_created` series per counter would double the page; prometheus-client can only turn
        # them off for the whole process (as vLLM does)
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._row_steps = 0
        self._step_tokens = 0
        counter, gauge = self._counter, self._gauge
        self.requests = counter(
            "rag_lookahead_requests_total",
            "HTTP requests by endpoint and status code (499: the client left before the answer).",
            ("endpoint", "status"),
        )
        self.connections_closed = counter(
            "rag_lookahead_connections_closed_total",
            "Connections the server's protocol closed on its own: too_many_connections (--max-connections,"
            " answered 503) or head_timeout (--head-timeout: no complete request head in time, 408 when one"
            " was begun; or a body still arriving after its answer).",
            ("reason",),
        )
        self.tokens_generated = counter("rag_lookahead_tokens_generated_total", "Tokens generated over all requests.")
        self.forward_passes = counter(
            "rag_lookahead_forward_passes_total",
            "Batched forwards in which a row decoded (forwards of prompt chunks alone are prefill).",
        )
        self.prefills = counter(
            "rag_lookahead_prefills_total",
            "Admissions of new prompts (each one or more requests; prefilled in one forward, or with"
            " --prefill-chunk inside the following decode steps).",
        )
        self.prompt_tokens = counter("rag_lookahead_prompt_tokens_total", "Prompt tokens admitted for prefill.")
        self.row_steps = counter("rag_lookahead_row_steps_total", "Decode steps summed over rows.")
        gauge(
            "rag_lookahead_mean_accepted_tokens",
            "Tokens gained per row and decode forward (1.0 = plain decoding).",
            self._mean_accepted,
        )
        # one count a request, whatever its n (RequestOutcome: every choice answered, else cancelled or failed)
        self.completed = counter("rag_lookahead_requests_completed_total", "Generation requests answered in full.")
        self.cancelled = counter(
            "rag_lookahead_requests_cancelled_total", "Generation requests dropped because the client left."
        )
        self.failed = counter(
            "rag_lookahead_requests_failed_total", "Generation requests ended with an error by the engine."
        )
        self.engine_errors = counter(
            "rag_lookahead_engine_errors_total", "Engine failures (prefill, step, retire); their requests got an error."
        )
        self.prefill_seconds = counter(
            "rag_lookahead_prefill_seconds_total",
            "Seconds spent admitting prompts; a prompt prefilled in chunks (--prefill-chunk) runs inside"
            " the steps: a step of prompt chunks alone counts here, one where a row also decoded in"
            " rag_lookahead_decode_seconds_total.",
        )
        self.decode_seconds = counter("rag_lookahead_decode_seconds_total", "Seconds spent in decode steps.")
        self.request_seconds = Histogram(
            "rag_lookahead_request_seconds",
            "Seconds from a generation request's submission to its full answer.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        # rows, not requests: a request of n choices waits and decodes as n
        gauge("rag_lookahead_queue_depth", "Choices waiting for a batch slot (n per request).", queue_depth)
        gauge("rag_lookahead_batch_size", "Rows in the running batches.", batch_size)
        gauge("rag_lookahead_requests_active", "Choices being admitted or decoded (n per request).", active)
        gauge(
            "rag_lookahead_ready",
            "1 while the engine serves (warmed up, running, not draining: /health's ok); 0 before, while"
            " draining, and once it has stopped or failed.",
            lambda: 1 if ready() else 0,
        )
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends

    def _counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, help, labels, registry=self.registry)

    def _gauge(self, name: str, help: str, read: Callable[[], float]) -> Gauge:
        metric = Gauge(name, help, registry=self.registry)
        metric.set_function(read)
        return metric

    def request(self, endpoint: str, status: int) -> None:
        """Count one HTTP response."""
        self.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    def connection_closed(self, reason: str) -> None:
        """Count one connection the protocol closed on its own (see :mod:`rag_lookahead.serve.head`)."""
        self.connections_closed.labels(reason).inc()

    def settle(self, job, outcome: str, seconds: float = 0.0) -> None:
        """One choice of a request ended (``outcome``: completed, cancelled or failed); the request
        is counted once its last choice has ended (see ``serve.jobs.RequestOutcome``)."""
        ended = job.outcome.settle(outcome, seconds)
        if ended is None:
            return
        outcome, seconds = ended
        getattr(self, outcome).inc()
        if outcome == "completed":
            self.request_seconds.observe(seconds)

    def prefill(self, seconds: float, prompt_tokens: int) -> None:
        self.prefills.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.prefill_seconds.inc(seconds)

    def step(self, rows: int, tokens: int, seconds: float) -> None:
        """One batched forward in which ``rows`` decoding rows gained ``tokens`` tokens in all (rows
        taking a prompt chunk are not counted; a forward of chunks alone is prefill time)."""
        if not rows:
            self.prefill_seconds.inc(seconds)
            return
        with self._lock:
            self._row_steps += rows
            self._step_tokens += tokens
        self.forward_passes.inc()
        self.row_steps.inc(rows)
        self.decode_seconds.inc(seconds)

    def _mean_accepted(self) -> float:
        with self._lock:
            return self._step_tokens / self._row_steps if self._row_steps else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
