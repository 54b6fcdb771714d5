"""The endpoints. Each handler validates (its request model, then the server's limits), tokenizes
off the event loop, submits one job per choice and answers whole or as server-sent events.

``POST /v1/completions`` (raw prompt, no chat template; a string or a list of token ids),
``POST /v1/chat/completions`` (messages, and tools, through the tokenizer's chat template), ``POST /v1/rag``
(retrieve from the loaded index, seed the drafter with the passages left out of the prompt);
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from rag_lookahead.errors import ConfigError, InputError, first_line
from rag_lookahead.serve.api_error import ApiError, ErrorResponse, quote
from rag_lookahead.serve.body import JsonBodyRoute
from rag_lookahead.serve.chat_protocol import ChatCompletionRequest
from rag_lookahead.serve.engine import Engine
from rag_lookahead.serve.jobs import Answer, Job
from rag_lookahead.serve.limits import (
    answer_length,
    check_prompt_length,
    checked_messages,
    checked_prompt,
    checked_stop,
    checked_text_length,
    prompt_fits,
)
from rag_lookahead.serve.logprobs import AnswerLogprobs, LogprobFormat
from rag_lookahead.serve.metrics import CONTENT_TYPE
from rag_lookahead.serve.protocol import CompletionRequest, GenerationRequest, RagRequest
from rag_lookahead.serve.responses import (
    ChatCompletion,
    ChatShape,
    Completion,
    CompletionShape,
    Health,
    ModelCard,
    ModelList,
    RagAnswer,
    RagShape,
)
from rag_lookahead.serve.streaming import ClientGone, EngineStream, collect, stream
from rag_lookahead.serve.tool_calls import ToolSetup, tool_setup
from rag_lookahead.tokens import TextTracker, chat_template_text

__all__ = ["generation", "status"]

log = logging.getLogger(__name__)

#: The POST endpoints: the body is read by JsonBodyRoute, then validated by FastAPI.
generation = APIRouter(route_class=JsonBodyRoute)
#: The GET endpoints.
status = APIRouter()

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 413, 429, 500, 503)}
_ids = itertools.count()


def _documented(model: type) -> dict:
    """OpenAPI ``responses`` of a generation endpoint: the model, or events when streaming."""
    streamed = {"text/event-stream": {"schema": {"type": "string"}}}
    return {
        200: {"model": model, "description": "the answer; with stream: true, events", "content": streamed},
        **_ERRORS,
    }


def _engine(http_request: Request) -> Engine:
    return http_request.app.state.engine


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}{next(_ids)}"


def _length_and_stop(body: GenerationRequest, engine: Engine) -> tuple[int, list[str]]:
    if body.stop_token_ids and not set(body.stop_token_ids) <= engine.eos:  # the model's own EOS ids change nothing
        raise ApiError(
            400,
            f"'stop_token_ids' is not supported by this server beyond the model's end-of-answer ids "
            f"{sorted(engine.eos)}: leave it out",
            param="stop_token_ids",
        )
    config = engine.config
    return answer_length(*body.answer_length(), config), checked_stop(body.stop_strings, config)


def _sampling(engine: Engine, options: dict, prompt_width: int):
    """``engine.sampling``, a setting it cannot apply (the model's own, with the request's) a 400."""
    try:
        return engine.sampling(options, prompt_width)
    except ConfigError as e:
        raise ApiError(
            400, f"{first_line(e)[:300]} (the request's fields over the model's generation config)"
        ) from None


def _submit(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    stop: list[str],
    body: GenerationRequest,
    http_request: Request,
    tools: ToolSetup | None = None,
) -> list[Job]:
    """One job per choice (``n``) of each prompt, queued together (choice i of prompt p is job
    p * n + i); choice i of a seeded request draws with seed + i. A job records log-probabilities
    when asked; with tools its text opens with a forced call and holds calls back."""
    key = getattr(http_request.state, "key_id", "")
    options = body.sampling_options()
    jobs = []
    for prompt in prompts:
        sampling = _sampling(engine, options, len(prompt))  # the prompt's width counts (min_new_tokens)
        jobs += [
            engine.new_request(prompt, max_tokens, stop, pool_key=key, sampling=body.choice_sampling(sampling, i))
            for i in range(body.choices)
        ]
    for job in jobs:
        if body.top_logprobs_asked is not None:
            job.logprobs = AnswerLogprobs(body.top_logprobs_asked)
        if tools is not None and tools.tools:
            job.tracker = TextTracker(engine.tokenizer, stop, engine.eos, prefix=tools.opening, hold=tools.hold)
    engine.submit(*jobs)
    return jobs


def _logprob_format(body: GenerationRequest, engine: Engine) -> LogprobFormat | None:
    return None if body.top_logprobs_asked is None else LogprobFormat(engine.tokenizer)


async def _collect_all(jobs: list[Job], http_request: Request, engine: Engine) -> list[Answer] | None:
    """Every choice's answer; None (all of them cancelled) once the client has left. A choice that
    fails stops its siblings before its error is answered: nobody would read them."""

    async def one(job: Job) -> Answer | None:
        try:
            return await collect(job, http_request, engine)
        except ClientGone:
            return None

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # collect cancels its job on the way out; a finished task ignores this
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if any(answer is None for answer in answers):
        for job in jobs:
            engine.cancel(job)
        return None
    return list(answers)


async def _respond(
    jobs: list[Job],
    shape: CompletionShape | ChatShape | RagShape,
    streamed: bool,
    include_usage: bool,
    http_request: Request,
    engine: Engine,
) -> Response:
    """The answer in ``shape``: events as they come, or the whole body (499 if the client left).
    The body is sent as built: a dict returned to FastAPI goes through ``jsonable_encoder``,
    which drops every key starting with "_sa" (SQLAlchemy's), e.g. a top log-probability's "_save"."""
    if streamed:
        return EngineStream(stream(jobs[0], http_request, engine, shape, include_usage), engine, jobs[0])
    answers = await _collect_all(jobs, http_request, engine)
    return Response(status_code=499) if answers is None else JSONResponse(shape.whole(answers))


@generation.post("/v1/completions", response_model=None, responses=_documented(Completion))
async def completions(body: CompletionRequest, http_request: Request) -> Response:
    engine = _engine(http_request)
    max_tokens, stop = _length_and_stop(body, engine)
    engine.check_capacity(len(body.prompts) * body.choices)  # before tokenizing what could never be queued
    several = len(body.prompts) > 1
    prompts = []
    for i, prompt in enumerate(body.prompts):
        named = f"'prompt'[{i}]" if several else None  # several: name the one refused
        if isinstance(prompt, str):
            checked_text_length(len(prompt), engine.config, "prompt", named)
            prompt = await run_in_threadpool(engine.encode_text, prompt)
        prompts.append(checked_prompt(list(prompt), engine, what=named or "the prompt"))
    jobs = _submit(engine, prompts, max_tokens, stop, body, http_request)
    model = body.model or engine.config.model_name
    logprobs = _logprob_format(body, engine)
    shape = CompletionShape(_new_id("cmpl"), int(time.time()), model, logprobs, prompts=len(prompts))
    return await _respond(jobs, shape, bool(body.stream), body.include_usage, http_request, engine)


@generation.post("/v1/chat/completions", response_model=None, responses=_documented(ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
    engine = _engine(http_request)
    if not chat_template_text(engine.tokenizer):  # contents joined without roles was a silent 200
        raise ApiError(
            400,
            "this model's tokenizer has no chat template, so messages cannot be made into a prompt: "
            "send the text to /v1/completions",
            param="messages",
        )
    max_tokens, stop = _length_and_stop(body, engine)
    template_tools = body.template_tools()
    messages = checked_messages(body.messages, engine.config, (template_tools, body.chat_template_kwargs))
    tools = tool_setup(
        template_tools,
        body.plain_tool_choice(),
        body.parallel_tool_calls,
        engine.tokenizer,
        engine.config.model_name,
    )
    engine.check_capacity(body.choices)  # before the chat template: n over the queue's cap, or no room now
    prompt = await _encode_chat(  # with tools, they go to the template and the answer opens with a call
        engine,
        messages,
        tools=tools.tools,
        answer_prefix=tools.opening,
        template_variables=body.chat_template_kwargs,
    )
    jobs = _submit(engine, [checked_prompt(prompt, engine, "messages")], max_tokens, stop, body, http_request, tools)
    model = body.model or engine.config.model_name
    shape = ChatShape(_new_id("chatcmpl"), int(time.time()), model, _logprob_format(body, engine), tools=tools)
    return await _respond(jobs, shape, bool(body.stream), body.include_usage, http_request, engine)


async def _encode_chat(
    engine: Engine, messages: list[dict], what: str = "these messages", param: str | None = "messages", **options
) -> list[int]:
    """``engine.encode_chat`` off the event loop (``options`` are its own); a template that refuses
    the messages (role order, a required system message) answers 400, never a 500 with a traceback,
    on every endpoint that builds a chat prompt. ``what`` and ``param`` name the messages refused."""
    try:
        return await run_in_threadpool(engine.encode_chat, messages, **options)
    except Exception as e:  # noqa: BLE001 - a template may raise anything; none of it is the server's fault
        raise _template_refusal(e, what, param) from None


def _template_refusal(error: Exception, what: str, param: str | None) -> ApiError:
    """The chat template refused the messages: its own message when it raised one on purpose, ours
    when :mod:`rag_lookahead.tokens` refused what the template did with them (a message left out)."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - transformers needs jinja2 for templates
        TemplateError = ()  # type: ignore[assignment]
    if isinstance(error, InputError) and error.__context__ is None and len(str(error)) <= 300:
        return ApiError(400, str(error), param=param)  # worded for people, raised on no other error
    if isinstance(error, InputError) and error.__context__ is not None:
        error = error.__context__  # tokens.encode_messages words it for people; judge the template's own error
    if isinstance(error, TemplateError) and str(error) and len(str(error)) <= 300:
        return ApiError(400, f"the chat template rejected {what}: {error}", param=param)
    # one line, no traceback: a nested tool schema made ~300 KB of traceback per 6 KB request
    log.info("chat template failed: %s: %.200s", type(error).__name__, error)
    return ApiError(400, f"the chat template rejected {what}", param=param)


@generation.post("/v1/rag", response_model=None, responses=_documented(RagAnswer))
async def rag(body: RagRequest, http_request: Request) -> Response:
    """Retrieve ``k_seed`` passages, show ``k`` in the prompt, seed the drafter with the rest."""
    from rag_lookahead.rag.chains import make_prompt, passage_prompt_words, source_info

    engine = _engine(http_request)
    cfg = engine.config
    k = cfg.k_prompt if body.k is None else body.k
    max_tokens = answer_length("max_tokens", body.max_tokens, cfg)
    if engine.index is None:
        raise ApiError(
            503,
            "no document index is loaded: build one with `rag_lookahead index CORPUS_DIR --index-dir DIR` "
            "and start the server with `--index-dir DIR`",
            "server_error",
        )
    checked_text_length(len(body.question), cfg, "question")
    # searched and shown stripped, as ask and the chains do (spaces around it moved the dense ranking)
    question = body.question.strip()
    engine.check_capacity()  # before tokenizing: the body may have been read while the server was full
    # before retrieving: a question the prompt limit or the model's context cannot hold with the
    # template around it and no passage yet (no k helps); the question alone was measured, so one
    # in the gap was retrieved for, then refused naming 'k' even at k=1
    bare = {"role": "user", "content": make_prompt(question, [])}
    alone = await _encode_chat(engine, [bare], "the prompt built from the question", None)
    what = "the prompt built from the question with no passage"
    check_prompt_length(len(alone), engine, "question", what, "; ask a shorter question: no 'k' makes room for it")
    engine.check_capacity()  # again: the tokenizing may have taken a while
    start = time.perf_counter()
    try:
        docs = await run_in_threadpool(engine.retrieve, question, max(cfg.k_seed, k))
    except InputError as e:
        raise ApiError(400, str(e)[:300], param="question") from None
    retrieval_seconds = time.perf_counter() - start
    shown, seeds = docs[:k], docs[k:]
    message = {"role": "user", "content": make_prompt(question, shown)}
    prompt = await _encode_chat(engine, [message], "the prompt built from the question", None)
    # with one passage k is at its least: only a shorter question makes room (the client cannot
    # re-index); so too where the first passage alone leaves no room (measured only when refused)
    one_fits = True
    if len(shown) > 1 and not prompt_fits(len(prompt), engine):
        first = {"role": "user", "content": make_prompt(question, shown[:1])}
        one_fits = prompt_fits(
            len(await _encode_chat(engine, [first], "the prompt built from the question", None)), engine
        )
    what, advice = passage_prompt_words(len(shown), "'k'", "ask a shorter question", one_fits)
    ids = checked_prompt(prompt, engine, "k" if len(shown) > 1 and one_fits else "question", what, advice)
    # the seed passages encoded once the prompt is taken: a refused one paid for them
    seeded = engine.lookahead.enabled and seeds
    references = await run_in_threadpool(engine.encode_passages, [d.page_content for d in seeds]) if seeded else []
    key = getattr(http_request.state, "key_id", "")
    job = engine.new_request(ids, max_tokens, [], references, pool_key=key, sampling=_sampling(engine, {}, len(ids)))
    engine.submit(job)
    sources = [source_info(d, i < k) for i, d in enumerate(docs)]
    shape = RagShape(sources, cfg.model_name, retrieval_seconds, len(seeds))
    return await _respond([job], shape, bool(body.stream), False, http_request, engine)


@status.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def models(http_request: Request) -> dict:
    return ModelList(data=[ModelCard(id=_engine(http_request).config.model_name)]).model_dump()


@status.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, responses={**_ERRORS, 404: {"model": ErrorResponse}}
)
async def model(model_id: str, http_request: Request) -> dict:
    """One model's card (the SDK's ``client.models.retrieve``); ``:path``, as a hub id holds a "/".
    Another id answers 404 as OpenAI answers an unknown model (``model_not_found``)."""
    name = _engine(http_request).config.model_name
    if model_id != name:
        raise ApiError(
            404,
            f"the model {quote(model_id)} does not exist here: this server serves {quote(name)}",
            code="model_not_found",
        )
    return ModelCard(id=name).model_dump()


@status.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(http_request: Request) -> JSONResponse:
    engine = _engine(http_request)
    state = engine.health
    body = Health(
        status=state,
        model=engine.config.model_name,
        lookahead=engine.lookahead.enabled,
        index=engine.index is not None,
        queue_depth=engine.queue_depth,
        batch_size=engine.batch_size,
        max_batch_size=engine.max_batch_size,
        error="the generation engine is not running; the server log has the details" if state == "error" else None,
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if state == "ok" else 503)


# HEAD (load balancers' probes) answers as GET does; one operation in the schema, not two of one id
status.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@status.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(http_request: Request) -> Response:
    return Response(_engine(http_request).metrics.render(), media_type=CONTENT_TYPE)
