"""``rag_lookahead serve`` (and ``python -m rag_lookahead.serve``): the server's command line.

Every option but the lookahead switches has the name of a :class:`ServerConfig` field
(``--max-body-bytes`` is ``max_body_bytes``). A bad setting prints one line: exit 1 under the
``rag_lookahead`` command, as its other errors do, and 2 under ``python -m rag_lookahead.serve``,
as its argparse command did.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal, NoReturn

import click
import typer

from rag_lookahead.checks import hub_endpoint
from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, RagLookaheadError, first_line
from rag_lookahead.interrupts import interrupted, leave_now
from rag_lookahead.paths import cache_dir
from rag_lookahead.serve.config import (
    API_KEY_ENV,
    LOOPBACK,
    WILDCARD_BINDS,
    LogLevel,
    OutputPool,
    ServerConfig,
    base_url,
)

__all__ = ["config_from_args", "main", "parse_args", "run_server", "serve"]

log = logging.getLogger(__name__)

_D = ServerConfig()  # the defaults the options show
#: ``ctx.obj`` key: the exit code of a bad setting (``python -m rag_lookahead.serve`` sets 2).
CONFIG_ERROR_EXIT = "config_error_exit"


def serve(
    ctx: typer.Context,
    host: str = typer.Option(_D.host, help="address to bind (default 127.0.0.1, loopback only)"),
    port: int = typer.Option(_D.port),
    model: str = typer.Option(_D.model, help='"default" or "quality" (embedded), a hub id or a local folder'),
    served_model_name: str | None = typer.Option(None, help="model name reported in responses"),
    dtype: str | None = typer.Option(
        None, help="bf16, fp32, fp16 or auto (default: bf16 on GPUs and AMX CPUs, fp16 on GPUs without bf16, else fp32)"
    ),
    device: str | None = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"),
    device_map: str | None = typer.Option(
        None, help='accelerate device map, e.g. "auto" to spread the model over GPUs'
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="run the modeling code a model repo or folder ships (ChatGLM3, Qwen-1); only for sources you trust",
    ),
    index_dir: str | None = typer.Option(
        None, help="document index for /v1/rag (default: the default index, if built)"
    ),
    max_batch_size: int = typer.Option(_D.max_batch_size),
    max_queue: int = typer.Option(
        _D.max_queue, help="choices waiting beyond the batch (a request takes n); more get 429"
    ),
    max_queue_per_key: int | None = typer.Option(
        None, help="choices one API key may have waiting; more get 429 (default: only --max-queue)"
    ),
    max_batch_tokens: int | None = typer.Option(
        None,
        help="KV token budget: each request holds prompt + max_tokens while waiting or running; past it 429 "
        "with Retry-After (default: a quarter of the free RAM, or half the free GPU memory, as KV cache)",
    ),
    prefill_chunk: int = typer.Option(
        _D.prefill_chunk, help="prompt tokens prefilled per step between decode steps (chunked prefill); 0: off"
    ),
    max_draft_rows: int | None = typer.Option(
        None,
        help="above this many rows in a batch, decode without drafting (default: 24 on a CPU, none on a GPU or "
        "with --budget fixed)",
    ),
    max_prompt_tokens: int = typer.Option(_D.max_prompt_tokens),
    max_tokens_limit: int = typer.Option(_D.max_tokens_limit),
    default_max_tokens: int = typer.Option(_D.default_max_tokens),
    k_prompt: int = typer.Option(_D.k_prompt, help="RAG passages shown to the model"),
    k_seed: int = typer.Option(_D.k_seed, help="RAG passages retrieved (the rest seed the trie)"),
    max_stop: int = typer.Option(_D.max_stop, help="most stop strings in a request"),
    max_stop_chars: int = typer.Option(_D.max_stop_chars, help="longest stop string"),
    max_messages: int = typer.Option(_D.max_messages, help="most chat messages in a request"),
    max_body_bytes: int = typer.Option(_D.max_body_bytes, help="largest request body (413 beyond)"),
    body_timeout: float = typer.Option(_D.body_timeout, help="seconds a client may take to send a body (408 beyond)"),
    head_timeout: float = typer.Option(
        _D.head_timeout, help="seconds a client may take to send a request line and headers (408 beyond)"
    ),
    max_connections: int = typer.Option(
        _D.max_connections, help="most connections open at once (one more gets 503 and is closed)"
    ),
    drain_seconds: float = typer.Option(
        _D.drain_seconds, help="on SIGTERM, time for accepted requests to finish while new ones get 503"
    ),
    api_keys: list[str] | None = typer.Option(
        None,
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (repeat for several keys; default ${API_KEY_ENV}, "
        "its keys comma-separated; prefer the variable: flags are visible to other local users)",
    ),
    allowed_hosts: list[str] | None = typer.Option(
        None,
        "--allowed-hosts",
        metavar="HOST[,HOST]",
        help="Host names accepted besides the bound host and loopback ('*': any; needed behind a proxy or a DNS name)",
    ),
    output_pool: OutputPool = typer.Option(
        _D.output_pool,
        help="shared: earlier answers speed up everyone (and stats can reveal them); "
        "per-key: one pool per API key; off",
    ),
    no_lookahead: bool = typer.Option(False, "--no-lookahead", help="decode one token a forward (same text)"),
    decoding_length: int | None = typer.Option(None, help="most draft nodes per forward"),
    branch_length: int | None = typer.Option(None, help="deepest draft path"),
    output_pool_nodes: int | None = typer.Option(
        None, help="node cap of the pool of earlier answers (per-key pools share it; ~170 bytes a node)"
    ),
    budget: Literal["auto", "fixed"] | None = typer.Option(None),
    log_level: LogLevel = typer.Option(_D.log_level, case_sensitive=False),
    replicas: int = typer.Option(0, help="serve N replicas on Ray Serve (needs rag-lookahead\\[ray]); 0: one process"),
    max_replicas: int | None = typer.Option(None, help="with --replicas: autoscale from --replicas up to this many"),
    replica_cpus: float = typer.Option(1.0, help="with --replicas: CPUs (torch threads) per CPU replica"),
) -> None:
    """OpenAI-compatible server with continuous batching and lossless lookahead decoding.
    \f
    Long only by its option list; the options are read back from ``ctx.params``.
    """
    from rag_lookahead.decoding.costs import recalibrate_asked
    from rag_lookahead.serve.ray_deploy import run_on_ray, settings_from_args

    try:
        config = config_from_args(ctx.params)
        ray_settings = settings_from_args(ctx.params)  # None without --replicas: one process, no Ray
        cache_dir()  # a relative $RAG_LOOKAHEAD_CACHE, said now: warm-up reads it after the server is up
        if config.lookahead and (config.lookahead_config or LookaheadConfig()).budget == "auto":
            recalibrate_asked()  # so is a RAG_LOOKAHEAD_RECALIBRATE that is neither yes nor no, where it is read
        hub_endpoint()  # a $HF_ENDPOINT huggingface_hub cannot parse: a traceback from the model load
    except ConfigError as e:
        _refuse(said_as_flags(e, ctx.command), _config_error_exit(ctx))
    try:
        if ray_settings is None:
            run_server(config)
        else:
            _warn_about_exposure(config)
            _warn_about_proxy_limits(config)
            run_on_ray(config, ray_settings)
    except RagLookaheadError as e:  # the address, the model or the index would not do: exit 1 (see main)
        _refuse(e, 1)


def config_from_args(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The ``serve`` options (by parameter name, as :func:`parse_args` gives them) as a config: the
    options that share a field's name, the lookahead switches, and the API keys (``--api-key``,
    else ``$RAG_LOOKAHEAD_API_KEY``)."""
    environ = os.environ if environ is None else environ
    flags = dict(args)
    flags["api_keys"] = _api_keys(flags.get("api_keys"), environ.get(API_KEY_ENV, ""))
    flags["allowed_hosts"] = _split_commas(flags.get("allowed_hosts"))
    same = {f.name: flags[f.name] for f in fields(ServerConfig) if f.name in flags}
    changes = {
        k: flags[k]
        for k in ("decoding_length", "branch_length", "budget", "output_pool_nodes")
        if flags.get(k) is not None
    }
    return ServerConfig(
        **same,
        lookahead=not flags.get("no_lookahead", False),
        lookahead_config=LookaheadConfig(**changes) if changes else None,
    )


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    """The options ``serve`` takes from ``argv``, by parameter name (for :func:`config_from_args`)."""
    command = typer.main.get_command(_standalone_app())
    with command.make_context("serve", list(argv)) as ctx:
        return dict(ctx.params)


def run_server(config: ServerConfig) -> None:
    """Take the address, load the model, serve until SIGTERM or SIGINT (then drain; see
    :func:`make_server`). The address is taken first so a port in use is said at once, not after
    the model has loaded."""
    from rag_lookahead.serve.app import create_app, make_server
    from rag_lookahead.torch_threads import LeftRunning

    logging.basicConfig(
        level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.log_level in ("info", "warning", "error", "critical"):  # faiss's fallback, not a fault:
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # "Could not load library with AVX512 support"
    with listening_socket(config.host, config.port) as sock:
        _warn_about_exposure(config)  # once the address is taken: a host that does not resolve is one line
        try:
            app = create_app(config)
        except LeftRunning:  # the model still loads, busy in torch: Python's own exit would abort under it
            leave_now(130)
        # uvicorn names no address for a socket it is handed: said here (the port --port 0 took)
        log.info("serving %s at %s", config.model_name, base_url(*sock.getsockname()[:2]))
        make_server(app, app.state.engine).run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rag_lookahead.serve``: a bad setting is one line and exit 2; what fails as the
    server starts (the address taken or not resolving, a model or device that will not load,
    Ray missing) is one line and exit 1, as under ``rag_lookahead serve``."""
    command = typer.main.get_command(_standalone_app())
    try:
        command.main(args=argv, prog_name="python -m rag_lookahead.serve", obj={CONFIG_ERROR_EXIT: 2})
    except SystemExit as done:  # typer prints usage errors itself (exit 2), as argparse did
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0


def _standalone_app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(serve)
    return app


def _config_error_exit(ctx: typer.Context) -> int:
    obj = ctx.find_root().obj
    return obj.get(CONFIG_ERROR_EXIT, 1) if isinstance(obj, dict) else 1


#: a value a message quotes as given (``repr``): said as typed, never renamed inside
_QUOTED = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def said_as_flags(error: ConfigError, command: click.Command) -> ConfigError:
    """``error`` with the config fields it names said as the options that set them: ``serve
    --max-body-bytes 100`` said "max_body_bytes must be ..." (``ServerConfig``'s and
    ``LookaheadConfig``'s checks name their fields). A field of one word is renamed only where
    it starts the message ("port must be ..."), not where the word is plain prose ("model"), and
    nothing inside a quoted value (``--allowed-hosts 'http://h/max_queue'`` is echoed as typed)."""
    parts = _QUOTED.split(str(error))  # odd places: the quoted values
    for param in command.params:
        flags = [opt for opt in param.opts if opt.startswith("--")]
        if not (param.name and flags):
            continue
        flag = max(flags, key=len)
        if "_" in param.name:
            field = re.compile(rf"(?<![\w-]){re.escape(param.name)}(?![\w-])")
            parts[::2] = [field.sub(flag, part) for part in parts[::2]]
        elif parts[0].startswith(f"{param.name} "):
            parts[0] = flag + parts[0][len(param.name) :]
    text = "".join(parts)
    return error if text == str(error) else ConfigError(text)


def _refuse(error: BaseException, exit_code: int) -> NoReturn:
    """One line on stderr, no traceback; after a Ctrl-C, exit 130 quietly (see ``interrupts``)."""
    if interrupted():
        raise typer.Exit(130)
    typer.echo(f"error: {first_line(error)}", err=True)
    raise typer.Exit(exit_code)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 or IPv6, as the host resolves), or a ConfigError."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        dual = family == socket.AF_INET6 and host in WILDCARD_BINDS and socket.has_dualstack_ipv6()
        return socket.create_server((host, port), family=family, backlog=2048, dualstack_ipv6=dual)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err


def _api_keys(flags: Sequence[str] | None, environ_value: str) -> tuple[str, ...]:
    """Keys from ``--api-key`` (each taken whole), else ``$RAG_LOOKAHEAD_API_KEY`` (comma-separated;
    set to "": no keys, as unset). A flag that is blank, or a variable of spaces or commas only, is
    refused: it would otherwise run the server open while the caller meant to set a key."""
    if flags:
        if not all(key.strip() for key in flags):
            raise ConfigError("--api-key is empty (an unset variable?): give the key, or leave the option out")
        return tuple(key.strip() for key in flags)
    keys = _split_commas([environ_value])
    if environ_value and not keys:
        raise ConfigError(
            f"${API_KEY_ENV} holds no key ({environ_value!r}): give keys separated by commas, or unset it"
        )
    return keys


def _split_commas(values: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def _warn_about_proxy_limits(config: ServerConfig) -> None:
    """Under Ray Serve its proxy owns the connections: say so for the connection limits set."""
    unapplied = [
        flag
        for flag, name in (("--head-timeout", "head_timeout"), ("--max-connections", "max_connections"))
        if getattr(config, name) != getattr(_D, name)
    ]
    if unapplied:
        log.warning(
            "%s: not applied with --replicas (Ray Serve's proxy owns the connections; put a reverse proxy in front)",
            ", ".join(unapplied),
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
