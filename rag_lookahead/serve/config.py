"""Every setting of the server in one dataclass, checked when it is made.

A bad setting raises :class:`rag_lookahead.errors.ConfigError` naming the field, so the command
line prints one line and a Python caller gets the same words. The upper bounds keep a typo from
allocating the machine away.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError
from rag_lookahead.paths import refuse_blank_path

__all__ = [
    "API_KEY_ENV",
    "LOG_LEVELS",
    "LogLevel",
    "LOOPBACK",
    "OUTPUT_POOL_MODES",
    "OutputPool",
    "WILDCARD_BINDS",
    "ServerConfig",
    "base_url",
]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
API_KEY_ENV = "RAG_LOOKAHEAD_API_KEY"


def base_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


OutputPool = Literal["shared", "per-key", "off"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
OUTPUT_POOL_MODES: tuple[str, ...] = get_args(OutputPool)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
MiB = 1 << 20

#: (low, high) of every integer setting.
INT_RANGES: dict[str, tuple[int, int]] = {
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
    "prefill_chunk": (0, 1_000_000),
    "max_connections": (1, 1_000_000),
    "memory_sharers": (1, 1_000_000),
}

#: (low, high) of the integer settings that may be None (None: worked out at start, or no limit).
OPTIONAL_INT_RANGES: dict[str, tuple[int, int]] = {
    "max_batch_tokens": (1, 1_000_000_000),
    "max_draft_rows": (1, 1024),
    "max_queue_per_key": (1, 1_000_000),
}


@dataclass
class ServerConfig:
    """Every knob of the server; the ``serve`` options mirror these names (``--max-body-bytes`` ...).

    host/port: where to listen (loopback by default).
    model: "default" or "quality" (embedded), a hub id or a local folder (see :func:`rag_lookahead.models.load_model`).
    served_model_name: the name reported in responses when the request names none.
    trust_remote_code: run the modeling code a hub repo or local folder ships (ChatGLM3, Qwen-1;
        off by default, since that code runs with the server's rights); the embedded models ignore it.
    index_dir: document index for ``/v1/rag`` (None: the default index if it exists).
    max_batch_size: most rows decoded together.
    max_queue: most choices waiting for a batch slot (a request with ``n`` choices takes ``n``
        places); more are refused with 429, a request with more than ``max_queue`` choices with 400.
    max_queue_per_key: most choices one API key may have waiting (429 beyond; None: only
        ``max_queue``). Whatever this is, free batch slots go to the waiting keys by turns.
    max_batch_tokens: the KV token budget: each request holds prompt + max_tokens tokens from
        submission to its end, and one that would take the running and waiting requests past
        the budget is refused with 429 and a Retry-After header (400 if it alone exceeds it).
        None: worked out at start from the memory free for the KV cache
        (:func:`rag_lookahead.serve.admission.default_token_budget`).
    memory_sharers: servers that share this machine's free memory (Ray replicas on one node, set
        by ``--replicas``): the default KV budget's share of it is divided among them (each took a
        quarter of the node's free RAM, so 4 replicas budgeted all of it).
    prefill_chunk: prompt tokens prefilled per engine step, between the running requests'
        decode steps (chunked prefill: a long prompt no longer stalls every stream); 0: each
        admitted prompt in one forward.
    max_draft_rows: above this many rows in a batch nobody drafts (at high concurrency trees
        cost more than they save); None: the device's measured default
        (``decode_batch.MAX_DRAFT_ROWS``: 24 on a CPU, no limit on a GPU; none with a fixed budget).
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
    body_timeout: seconds a client may take to send a request's body (408 past it): a client
        that stalls mid-upload would otherwise hold its connection and handler for good.
    head_timeout: seconds a client may take to send a request's line and headers, counted from
        the connection's opening or the head's first byte (408 past it, and the connection
        closes), and to finish a body the server has already answered (then it closes): a
        client that trickles a byte now and then (slowloris) would otherwise hold its
        connection for good.
    max_connections: most connections open at once; one more gets 503 and is closed as it opens
        (each holds a file descriptor and a slot in the event loop: a flood of connections would
        otherwise run the process out of descriptors, failing model and index reads too).
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
    trust_remote_code: bool = False
    index_dir: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    max_queue_per_key: int | None = None
    max_batch_tokens: int | None = None
    memory_sharers: int = 1
    prefill_chunk: int = 512
    max_draft_rows: int | None = None
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
    body_timeout: float = 30.0
    head_timeout: float = 30.0
    max_connections: int = 512
    drain_seconds: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in logs
    allowed_hosts: tuple[str, ...] = ()
    output_pool: OutputPool = "shared"
    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_strings()
        self.api_keys = _key_tuple(self.api_keys)
        self.allowed_hosts = _host_tuple(self.allowed_hosts)
        if self.output_pool not in OUTPUT_POOL_MODES:
            raise ConfigError(f"output_pool must be one of {', '.join(OUTPUT_POOL_MODES)}, got {self.output_pool!r}")
        if self.max_queue_per_key is not None and not self.api_keys:  # else every request is one key's
            raise ConfigError("max_queue_per_key needs API keys (--api-key or $RAG_LOOKAHEAD_API_KEY); use max_queue")
        if self.output_pool == "per-key" and not self.api_keys:
            raise ConfigError("output_pool 'per-key' needs API keys (--api-key or $RAG_LOOKAHEAD_API_KEY)")

    def _check_numbers(self) -> None:
        for name, (low, high) in INT_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in {low}..{high}, got {value!r}")
        for name, (low, high) in OPTIONAL_INT_RANGES.items():
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high
            ):
                raise ConfigError(f"{name} must be an integer in {low}..{high} or None, got {value!r}")
        if self.k_seed < self.k_prompt:
            raise ConfigError(f"k_seed must be >= k_prompt ({self.k_prompt}), got {self.k_seed}")
        for name, low in (("drain_seconds", 0), ("body_timeout", 0.001), ("head_timeout", 0.001)):
            seconds = getattr(self, name)
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not low <= seconds <= 86_400:
                raise ConfigError(f"{name} must be a number in {low:g}..86400, got {seconds!r}")
            setattr(self, name, float(seconds))
        for name in ("lookahead", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
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
            if name == "index_dir":  # "  " was loaded as a folder named so, after the model
                refuse_blank_path(value, name, "name the index folder, or leave it out")
            if value is not None and (not isinstance(value, str) or not value or len(value) > 4096):
                raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def model_name(self) -> str:
        """The model name responses report when a request names none."""
        if self.served_model_name:
            return self.served_model_name
        from rag_lookahead.models import reported_name

        return reported_name(self.model)

    @property
    def default_tokens(self) -> int:
        """``max_tokens`` of a request that gives none."""
        return min(self.default_max_tokens, self.max_tokens_limit)


def _string_tuple(values: Any, what: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, set, frozenset)):
        raise ConfigError(f"{what} must be a list of strings, got {type(values).__name__}")
    if len(values) > 1024:
        raise ConfigError(f"{what} holds {len(values)} entries; at most 1024")
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"{what} must hold strings, got {type(value).__name__}")
    return tuple(values)


def _key_tuple(keys: Any) -> tuple[str, ...]:
    """API keys: 8-4096 visible ASCII characters each, so they travel in a header unchanged."""
    keys = _string_tuple(keys, "api_keys")
    for key in keys:
        if not 8 <= len(key) <= 4096 or not all("!" <= c <= "~" for c in key):
            raise ConfigError("an API key must be 8 to 4096 visible ASCII characters (no spaces)")
    return tuple(dict.fromkeys(keys))


def _host_tuple(hosts: Any) -> tuple[str, ...]:
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
