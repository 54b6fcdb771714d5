"""The running decode batches of the engine thread: admit, step, retire, and fail what must fail.

One :class:`~rag_lookahead.decoding.decode_batch.DecodeBatch` per output pool key (``--output-pool
per-key`` keeps rows of different API keys in separate forwards). With ``prefill_chunk`` the
admitted prompts enter their batch a chunk per step, inside the running rows' decode steps
(``decoding.prefill``), and their first tokens arrive with the step that ends each prompt.

Failures are contained: an admission that fails fails the jobs it admitted (retried one by one
to find the one at fault), a failed step (prompt chunks included) or retire fails the batch it
ran on, a failure while turning one row's tokens into text fails that job only. Clients get a
short message with an error id; details go to the log.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.serve.api_error import ApiError, internal_error
from rag_lookahead.serve.config import ServerConfig
from rag_lookahead.serve.jobs import Answer, Job
from rag_lookahead.serve.metrics import Metrics
from rag_lookahead.tokens import accepted_per_step

__all__ = ["Batches"]


class Batches:
    """The batches, the jobs in them (``active``) and those being admitted. Only the engine thread
    changes them; other threads read ``size``, ``jobs`` and ``busy``."""

    def __init__(
        self,
        model,
        lookahead: LookaheadConfig,
        eos: frozenset[int],
        pad_id: int,
        config: ServerConfig,
        metrics: Metrics,
    ) -> None:
        self.model, self.lookahead, self.eos, self.pad_id = model, lookahead, eos, pad_id
        self.config, self.metrics = config, metrics
        self.active: dict[str, Job] = {}  # job id -> job, from its prefill until it is answered and counted
        self.admitting: dict[str, Job] = {}  # job id -> job, from leaving the queue until admitted or failed
        self._batches: dict[str, Any] = {}  # output pool key -> DecodeBatch
        self._pools: dict[str, Any] = {}  # output pool key -> OutputPool
        self.tokens_per_second = 0.0  # decode rate, all rows together (a moving average over steps)

    @property
    def busy(self) -> bool:
        """A job is being admitted or decoded, or not yet answered and counted. Read from other
        threads: ``admitting`` first, as a job joins ``active`` before it leaves ``admitting``."""
        return bool(self.admitting) or bool(self.active)

    @property
    def jobs(self) -> int:
        """Jobs being admitted or decoded (each once)."""
        return len({**self.active, **self.admitting})

    @property
    def size(self) -> int:
        """Rows in all batches, with those waiting for their first prompt chunk."""
        return sum(batch.size for batch in list(self._batches.values()))

    def new_batch(self, key: str = ""):
        from rag_lookahead.decoding.loop import DecodeBatch

        return DecodeBatch(
            self.model,
            self.lookahead,
            self.eos,
            self._pool(key),
            prefill_chunk=self.config.prefill_chunk,
            max_draft_rows=self.config.max_draft_rows,
        )

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
            pool = self._pools[key] = OutputPool(self.lookahead.pool_depth, nodes)
        return pool

    # ------------------------------------------------------------ admit

    def hold(self, jobs: list[Job]) -> None:
        """Mark ``jobs`` as being admitted as they leave the queue (the engine's lock held).
        Counted from their prefill only, they were in neither the queue nor ``active`` while a
        new batch was built: a drain, or a test waiting for the engine to be idle, saw it idle
        (a SIGTERM then could end a request it had accepted, and a metrics scrape miss it)."""
        self.admitting.update((job.id, job) for job in jobs)

    def admit(self, jobs: list[Job]) -> None:
        """One prefill per output pool for the held jobs, merged into its running batch."""
        live = [job for job in jobs if job.live]  # one look: a cancel between two looks was never counted
        for job in jobs:  # cancelled between leaving the queue and the prefill (later ones are retired and counted)
            if job.cancelled and job not in live:
                job.ended = True  # counted here once: a later failure of this round skips it
                self.metrics.settle(job, "cancelled")
        groups: dict[str, list[Job]] = {}
        for job in live:
            groups.setdefault(job.pool_key, []).append(job)
        for key, group in groups.items():
            self._admit_group(key, group)
        for job in jobs:  # each is active by now, or answered and counted
            self.admitting.pop(job.id, None)

    def _admit_group(self, key: str, group: list[Job]) -> None:
        """Prefill ``group``; on failure retry one by one so only the job at fault fails."""
        try:
            batch = self._batches.get(key)
            if batch is None:
                batch = self.new_batch(key)
        except Exception as e:  # noqa: BLE001
            self.fail(group, self.failure(e))
            return
        rows_before = batch.size
        for job in group:  # active from here on: a drain or a test waiting for idle sees the prefill
            self.active[job.id] = job
        try:
            self._prefill(batch, group)
        except Exception as e:  # noqa: BLE001
            if batch.size != rows_before:  # it failed half-way through the merge: the batch is unsafe
                self._fail_batch(key, e, also=group)
                return
            for job in group:
                self.active.pop(job.id, None)
            if len(group) > 1:
                for job in group:
                    self._admit_group(key, [job])
            else:
                self.fail(group, self.failure(e))
            return
        self._batches[key] = batch

    def _prefill(self, batch, jobs: list[Job]) -> None:
        from rag_lookahead.decoding.loop import left_pad
        from rag_lookahead.decoding.verify import input_device

        ids, mask = left_pad([job.prompt_ids for job in jobs], self.pad_id, input_device(self.model))
        references = [job.references for job in jobs] if any(job.references for job in jobs) else None
        start = time.perf_counter()
        rows = batch.add(
            ids,
            mask,
            references,
            [job.max_tokens for job in jobs],
            keys=[job.id for job in jobs],
            sampling=[job.sampling for job in jobs],
            logprobs=[job.logprobs for job in jobs],
        )
        # chunked (batch.prefill set): the prompts are prefilled inside the next steps, timed there
        self.metrics.prefill(time.perf_counter() - start, sum(len(job.prompt_ids) for job in jobs))
        for job, row in zip(jobs, rows):
            self._deliver(job, row.generated)

    # ------------------------------------------------------------ step

    def step_all(self) -> None:
        """One propose -> verify -> accept step for every batch; each row's new text to its client."""
        for key, batch in list(self._batches.items()):
            if not batch.size:
                continue
            try:
                start = time.perf_counter()
                decoding = [not row.prefilling for row in batch.rows]  # the others take a prompt chunk
                gained = batch.verify_and_accept(batch.propose())
                seconds, tokens = time.perf_counter() - start, sum(len(g) for g in gained)
                # a row's first token comes with its last prompt chunk: a prefill's, not a decode step's
                self.metrics.step(sum(decoding), sum(len(g) for g, d in zip(gained, decoding) if d), seconds)
                rate = tokens / max(seconds, 1e-6)
                self.tokens_per_second = 0.8 * self.tokens_per_second + 0.2 * rate if self.tokens_per_second else rate
            except Exception as e:  # noqa: BLE001 - which row is at fault is unknown: the batch fails
                self._fail_batch(key, e)  # (a row whose own sampling fails ends alone: Row.failure)
                continue
            for row, new in zip(list(batch.rows), gained):
                job = self.active.get(row.index)
                if job is not None:
                    self._deliver(job, new)

    def _deliver(self, job: Job, tokens: list[int]) -> None:
        """Turn a row's new tokens into text for its client; a failure here fails that job only."""
        if not tokens or not job.live:
            return
        job.steps += 1
        before = len(job.tracker.ids)
        try:
            piece = job.tracker.add(tokens)
        except Exception as e:  # noqa: BLE001
            self.fail([job], self.failure(e))
            return
        # the tokens the answer keeps: a step may accept tokens past a stop string, which it drops
        self.metrics.tokens_generated.inc(len(job.tracker.ids) - before)
        if piece:
            job.emit(("piece", piece))

    # ------------------------------------------------------------ retire

    def retire_all(self) -> None:
        """Remove finished, stopped, cancelled and failed rows from every batch; answer them."""
        for key, batch in list(self._batches.items()):
            if batch.size:
                try:
                    left = batch.retire(self._keep)
                except Exception as e:  # noqa: BLE001 - the batch's bookkeeping is unknown now
                    self._fail_batch(key, e)
                    continue
                for row in left:
                    self._answer(row)
            if not batch.size:
                self._batches.pop(key, None)  # frees the KV cache; the next admission starts afresh

    def _keep(self, row) -> bool:
        job = self.active.get(row.index)
        return job is not None and job.live and not job.tracker.stopped

    def _answer(self, row) -> None:
        """Send a retired row's last event (or count it cancelled); only then is it no longer
        active (whoever sees the engine idle sees it counted)."""
        job = self.active.get(row.index)
        if job is None:
            return
        try:
            self._settle_retired(job, row)
        finally:
            self.active.pop(row.index, None)

    def _settle_retired(self, job: Job, row) -> None:
        if job.ended:
            return
        if job.cancelled:
            job.ended = True
            self.metrics.settle(job, "cancelled")
            return
        if row.failure is not None:  # choosing its tokens failed (its own sampling): it alone fails
            self.fail([job], self.failure(row.failure))
            return
        try:
            answer = self._final_answer(job, row)
        except Exception as e:  # noqa: BLE001
            self.fail([job], self.failure(e))
            return
        self.metrics.settle(job, "completed", answer.seconds)
        job.end(("done", answer))

    def _final_answer(self, job: Job, row) -> Answer:
        tracker = job.tracker
        rest = tracker.rest()
        stopped = tracker.stopped or bool(row.generated and row.generated[-1] in self.eos)
        decode_steps = max(job.steps - 1, 0)
        return Answer(
            text=tracker.final_text(),
            rest=rest,
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=len(tracker.ids),  # up to the token that completed a stop string, if one did
            forward_passes=decode_steps,
            mean_accepted=accepted_per_step(len(row.generated), decode_steps),
            seconds=round(time.perf_counter() - job.submitted, 4),
            lookahead=self.lookahead.enabled,
        )

    # ------------------------------------------------------------ failing jobs

    def failure(self, cause: BaseException) -> ApiError:
        """Count and log an engine failure; the error its jobs get (no internals in it)."""
        self.metrics.engine_errors.inc()
        return internal_error(500, "generation failed", cause)

    def fail(self, jobs: Sequence[Job], error: ApiError) -> None:
        """End each job with ``error``; their rows (if any) are dropped at the next retire.

        A job whose client already left ends silently (counted as cancelled: nothing counted it
        yet, since only jobs still in the queue are counted when they are cancelled). A job is
        no longer active or being admitted once answered and counted, not before."""
        for job in jobs:
            if not job.ended:
                if job.cancelled:
                    job.ended = True
                    self.metrics.settle(job, "cancelled")
                else:
                    self.metrics.settle(job, "failed")
                    job.end(("error", error))
            self.active.pop(job.id, None)
            self.admitting.pop(job.id, None)

    def _fail_batch(self, key: str, cause: BaseException, also: Sequence[Job] = ()) -> None:
        """A failure that cannot be pinned on one row: every job of the batch gets the error.

        The batch's jobs are the active ones of its pool key, not ``batch.rows``: a failure
        half-way through ``retire`` may have taken rows out already."""
        self._batches.pop(key, None)
        jobs = {job.id: job for job in also}
        jobs.update((job.id, job) for job in self.active.values() if job.pool_key == key)
        self.fail(list(jobs.values()), self.failure(cause))

    def drop_all(self) -> list[Job]:
        """Forget every batch; return the jobs in them or being admitted, for the caller to fail
        (``fail`` takes each out of ``active`` once it is answered)."""
        self._batches.clear()
        return list({**self.active, **self.admitting}.values())
