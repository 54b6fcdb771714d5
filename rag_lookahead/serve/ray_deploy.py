"""``rag_lookahead serve --replicas N``: the same FastAPI app on Ray Serve, N replicas behind one endpoint.

    pip install 'rag-lookahead[ray]'
    rag_lookahead serve --replicas 2 --index-dir ~/my_index              # one machine
    RAY_ADDRESS=auto rag_lookahead serve --replicas 8 --max-replicas 16 --host 0.0.0.0 --allowed-hosts llm.internal

Each replica is a Ray actor that builds the app with ``create_app`` from the one ServerConfig
(:mod:`rag_lookahead.serve.ray_replica`): its own model, engine, output pool, and index loaded from
``index_dir`` (a folder every node can read). The replicas get this command's local paths as
absolute ones and its settings' environment variables (:func:`local_paths_absolute`,
:func:`replica_env`): on a cluster ``ray start`` began elsewhere they run in its folder, with its
environment. A replica takes one GPU when the device is CUDA (or unset on a cluster with GPUs),
else ``num_cpus`` CPUs and as many torch threads. Ray's HTTP proxy listens on ``host:port`` on
every node.

Routing (:mod:`rag_lookahead.serve.ray_router`): requests with the same ``X-Session-Id`` header,
else the same API key, go to the same replica (consistent hashing) while it holds fewer than
``max_ongoing_requests``; past that they go to the next replica on the ring. Requests with neither
spread over the replicas.

``/metrics`` is per replica: each answer holds the counters of the replica named in its
``X-Replica-Id`` header (send an ``X-Session-Id`` to come back to the same one). Ray's own
metrics (``ray_serve_*``, on each node's Ray metrics port) count the whole deployment.

Differences from one process: past a replica's capacity requests wait in Ray's router, and
beyond ``max_queue`` (plus the replicas' capacity, which Ray counts as waiting while it hands
them over) Ray answers a plain-text 429 (one process answers 429 JSON). A replica that dies
fails its running requests with an error at once (Ray's proxy answers 500, or a started stream
ends early) and Ray starts another; the other replicas keep answering. On SIGTERM every replica
drains as one process does (:func:`drain`) before the app is deleted, except that requests still
waiting in Ray's router get the drain's 503 (one process would hold them in its queue). If this
node's raylet dies, the command exits 1 within seconds (Ray does not tell its driver), and the
drain waits on Ray only within its deadline (:mod:`rag_lookahead.serve.ray_probes`).

This module imports Ray only when a deployment starts, so the default install never does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rag_lookahead.checks import positive_int
from rag_lookahead.embedded_model import EMBEDDED
from rag_lookahead.errors import ConfigError, ModelLoadError, RagLookaheadError, first_line
from rag_lookahead.interrupts import flush_output, leave_now
from rag_lookahead.serve import ray_probes
from rag_lookahead.serve.config import API_KEY_ENV, ServerConfig, base_url

__all__ = [
    "APP_NAME",
    "INSTALL_HINT",
    "REPLICA_HEADER",
    "RayNodeLost",
    "RaySettings",
    "deploy",
    "deployment_options",
    "gpus_per_replica",
    "import_ray",
    "local_paths_absolute",
    "replica_config",
    "replica_env",
    "run_on_ray",
    "settings_from_args",
    "drain",
    "undeploy",
]

log = logging.getLogger(__name__)

APP_NAME = "rag_lookahead"
INSTALL_HINT = "pip install 'rag-lookahead[ray]'"
#: The response header naming the replica that answered (added by each replica).
REPLICA_HEADER = "x-replica-id"
#: Ray versions this module was written and tested against (the router reads Ray 2.60 internals).
SUPPORTED_RAY = "2.60."
#: Replica starts that may fail before the deploy does (at Ray's default, 20 loads of a model that will not load)
MAX_CONSTRUCTOR_RETRIES = 3


@dataclass(frozen=True)
class RaySettings:
    """How the app is spread over Ray Serve replicas.

    replicas: replicas to run (with ``max_replicas``: the count to start with).
    max_replicas / min_replicas: autoscale between ``min_replicas`` (default ``replicas``) and
        ``max_replicas``, aiming at ``target_ongoing_requests`` per replica (default: one full batch).
    num_cpus: CPUs (and torch threads) per CPU replica.
    num_gpus: GPUs per replica; None: 1 when the device is CUDA (or unset and the cluster has GPUs), else 0.
    max_ongoing_requests: a replica's capacity: past it, a session's request goes to the next
        replica; default two batches (``2 * max_batch_size``), at most ``max_batch_size + max_queue``.
    """

    replicas: int = 1
    max_replicas: int | None = None
    min_replicas: int | None = None
    num_cpus: float = 1.0
    num_gpus: float | None = None
    max_ongoing_requests: int | None = None
    target_ongoing_requests: float | None = None

    def __post_init__(self) -> None:
        positive_int("replicas", self.replicas)
        for name in ("max_replicas", "min_replicas", "max_ongoing_requests"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.max_replicas is None and self.min_replicas is not None:
            raise ConfigError("min_replicas needs max_replicas (autoscaling)")
        if self.max_replicas is not None and not self.lowest <= self.replicas <= self.max_replicas:
            raise ConfigError(
                f"replicas must lie within min_replicas..max_replicas ({self.lowest}..{self.max_replicas}), "
                f"got {self.replicas}"
            )
        for name in ("num_cpus", "num_gpus", "target_ongoing_requests"):
            value = getattr(self, name)
            if value is None and name != "num_cpus":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1024:
                raise ConfigError(f"{name} must be a number in 0..1024, got {value!r}")
        if self.num_cpus == 0 and not self.num_gpus:
            raise ConfigError("num_cpus must be > 0 for CPU replicas")

    @property
    def most_replicas(self) -> int:
        """The most replicas that may run at once (``max_replicas`` when autoscaling)."""
        return self.max_replicas or self.replicas

    @property
    def lowest(self) -> int:
        """The fewest replicas autoscaling keeps running."""
        if self.max_replicas is None:
            return self.replicas
        return self.min_replicas if self.min_replicas is not None else self.replicas


def settings_from_args(args: Mapping[str, Any]) -> RaySettings | None:
    """The ``serve`` options ``--replicas``, ``--max-replicas`` and ``--replica-cpus`` as settings;
    None without ``--replicas`` (one process, no Ray)."""
    cpus = args.get("replica_cpus")
    if not args.get("replicas"):
        if args.get("max_replicas") is not None:
            raise ConfigError("--max-replicas needs --replicas")
        if cpus is not None and cpus != 1.0:
            raise ConfigError("--replica-cpus needs --replicas")
        return None
    _check_port(args.get("port", 1))
    most = args.get("max_replicas")
    if isinstance(most, int) and isinstance(args["replicas"], int) and 0 < most < args["replicas"]:
        raise ConfigError(f"--max-replicas ({most}) is below --replicas ({args['replicas']}), the count to start with")
    try:
        return RaySettings(
            replicas=args["replicas"], max_replicas=args.get("max_replicas"), num_cpus=1.0 if cpus is None else cpus
        )
    except ConfigError as err:  # named as the command line names them
        raise ConfigError(_FIELD.sub(lambda m: _FLAGS[m.group()], str(err))) from None


#: RaySettings' fields as ``serve`` flags, for its errors
_FLAGS = {"replicas": "--replicas", "max_replicas": "--max-replicas", "num_cpus": "--replica-cpus"}
_FIELD = re.compile(r"(?<![\w-])(?:max_replicas|num_cpus|replicas)(?= must)")


def import_ray():
    """``(ray, ray.serve)``, or a ConfigError saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise ConfigError(f"--replicas needs Ray Serve, which is not installed: {INSTALL_HINT}") from err
    if not ray.__version__.startswith(SUPPORTED_RAY):
        log.warning("Ray %s: rag_lookahead's replicas are tested with Ray %sx only", ray.__version__, SUPPORTED_RAY)
    return ray, serve


def gpus_per_replica(config: ServerConfig, settings: RaySettings, cluster_gpus: float) -> float:
    """``settings.num_gpus``, else 1 for a CUDA device (or no device on a cluster with GPUs), else 0."""
    if settings.num_gpus is not None:
        return float(settings.num_gpus)
    device = (config.device or "").lower()
    if device.startswith("cuda") or (not device and config.device_map is None and cluster_gpus > 0):
        return 1.0
    return 0.0


def replica_config(config: ServerConfig, gpus: float, sharers: int = 1) -> ServerConfig:
    """The config each replica builds its app from: Ray shows a replica only its own GPU (``cuda``
    is that one; a replica on a fraction of a GPU too sees only that GPU, so ``cuda:1`` would name
    none there), and a replica without a GPU runs on the CPU; ``sharers`` replicas may share a
    node's memory (see :func:`memory_sharers`)."""
    if sharers != config.memory_sharers:
        config = dataclasses.replace(config, memory_sharers=sharers)
    device = (config.device or "").lower()
    if gpus > 0 and device.startswith("cuda:"):
        return dataclasses.replace(config, device="cuda")
    if gpus == 0 and not device and config.device_map is None:
        return dataclasses.replace(config, device="cpu")
    return config


def local_paths_absolute(config: ServerConfig) -> ServerConfig:
    """``config`` with its model folder (or .gguf file) and ``index_dir`` as absolute paths where
    they exist on this machine (``~`` expanded). Why: a replica on a cluster that ``ray start``
    began elsewhere runs in that cluster's working folder, where ``--model models/x`` named nothing
    and was looked up on the hub ("neither a local folder nor in the Hugging Face cache"). Responses
    still report the model by the name given."""
    changes: dict[str, Any] = {}
    name = config.model.strip()
    if name not in EMBEDDED and (model := _absolute_here(name)) not in (None, name):
        changes.update(model=model, served_model_name=config.model_name)
    if config.index_dir is not None and (index := _absolute_here(config.index_dir)) not in (None, config.index_dir):
        changes["index_dir"] = index
    return dataclasses.replace(config, **changes) if changes else config


def _absolute_here(path: str) -> str | None:
    """``path`` as an absolute path (``~`` expanded) where it names something on this machine, else None."""
    full = os.path.abspath(os.path.expanduser(path))
    return full if os.path.exists(full) else None


#: The environment variables that replicas read as this command does, sent with them (Ray's
#: ``runtime_env``): ours (``RAG_LOOKAHEAD_*``: the home with its default index, the cache, the CPU
#: kernel, the recalibration), the XDG folders, and where the Hugging Face cache is and whether the
#: hub may be asked. Why: replicas on a cluster that ``ray start`` began have the cluster's
#: environment, not this command's; ``$RAG_LOOKAHEAD_HOME``'s index loaded in one process and
#: silently not in the replicas (``/v1/rag`` answered 503).
REPLICA_ENV = (
    "XDG_CACHE_HOME",
    "XDG_DATA_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_MODULES_CACHE",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "TRANSFORMERS_OFFLINE",
)
REPLICA_ENV_PREFIX = "RAG_LOOKAHEAD_"
#: Never sent: Ray shows a runtime_env to whoever can read the cluster's state. The replicas' config
#: carries the API keys; a hub token (HF_TOKEN) is the cluster's to set.
REPLICA_ENV_SECRETS = frozenset({API_KEY_ENV})


def replica_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`REPLICA_ENV` (and ``RAG_LOOKAHEAD_*``) set in ``environ`` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return {
        name: value
        for name, value in environ.items()
        if name in REPLICA_ENV or (name.startswith(REPLICA_ENV_PREFIX) and name not in REPLICA_ENV_SECRETS)
    }


def memory_sharers(settings: RaySettings, gpus: float, node_cpus: Sequence[float]) -> int:
    """How many replicas may share one node's memory, so that their default KV budgets together
    stay within the one-process share: CPU replicas as many as fit the largest node's CPUs (at
    most the replicas asked for), replicas on a fraction of a GPU as many as share one GPU."""
    most = settings.most_replicas
    if gpus:
        return max(1, min(most, int(1 / gpus))) if gpus < 1 else 1
    fit = int(max(node_cpus, default=1.0) // settings.num_cpus) if settings.num_cpus else most
    return max(1, min(most, fit))


HEALTH_CHECK_PERIOD_S = 2.0  # check_health reads two attributes: cheap to ask often


def deployment_options(
    config: ServerConfig, settings: RaySettings, gpus: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ``serve.deployment`` options: resources, capacity, routing, draining and scaling; ``env``:
    environment variables the replicas get (:func:`replica_env`)."""
    from ray.serve.config import BackpressureConfig

    from rag_lookahead.serve.app import CLOSE_GRACE_SECONDS
    from rag_lookahead.serve.ray_router import ROUTER_PATH

    capacity = settings.max_ongoing_requests or min(2 * config.max_batch_size, config.max_batch_size + config.max_queue)
    options: dict[str, Any] = dict(
        name="LookaheadReplica",
        ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": gpus},
        max_ongoing_requests=capacity,
        # Ray's router counts a request still being assigned to a replica as queued: with only
        # --max-queue there, a burst of 6 at two idle replicas (queue 4) lost 2 to its 503
        max_queued_requests=config.max_queue + settings.most_replicas * capacity,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),  # as one process answers
        graceful_shutdown_timeout_s=config.drain_seconds + CLOSE_GRACE_SECONDS,
        request_router_config={"request_router_class": ROUTER_PATH},
        max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES,  # a model that will not load fails the deploy
        # a replica whose engine died answered 503 for 20-25 s at Ray's default 10 s period
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    if env:
        options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(env)}
    if settings.max_replicas is None:
        options["num_replicas"] = settings.replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": settings.lowest,
            "initial_replicas": settings.replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_ongoing_requests or config.max_batch_size,
        }
    return options


def deploy(config: ServerConfig, settings: RaySettings, ray_init: Mapping[str, Any] | None = None) -> str:
    """Start the replicas on Ray Serve (connecting to Ray, or starting it locally with ``ray_init``)
    and return the endpoint's base URL once every replica answers. Refuses, before starting
    anything, an address Ray Serve cannot take and a cluster that already runs this app."""
    ray, serve = import_ray()
    _check_port(config.port)
    _connect(ray, ray_init or {})
    resources = ray.cluster_resources()
    gpus = gpus_per_replica(config, settings, resources.get("GPU", 0.0))
    _check_fits(settings, gpus, resources)
    _check_serve_free(serve, config)
    claim = _claim_app(ray)
    try:
        base = _start(ray, serve, config, settings, gpus)
    except BaseException:
        with contextlib.suppress(Exception):  # the start's own error is the one to tell
            ray.kill(claim)
        raise
    _CLAIMS[APP_NAME] = claim  # released by undeploy, or by Ray when this driver exits
    return base


#: the named actor each deploy holds, per app name, while its app runs (see :func:`_claim_app`)
_CLAIMS: dict[str, Any] = {}


def _claim_app(ray):
    """Claim the app's name on the cluster with a named actor, which Ray creates once: two
    ``serve --replicas`` started at the same moment both passed :func:`_check_serve_free` (the app
    did not exist yet), both logged an address, and one served nothing. The actor needs no CPU and
    lives as long as this driver, so a command that dies frees the name."""

    @ray.remote(num_cpus=0)
    class ServeClaim:
        pass

    try:
        return ServeClaim.options(name=f"{APP_NAME}.claim", namespace=KV_NAMESPACE).remote()
    except ValueError:  # the name is taken
        raise ConfigError(
            f"another `rag_lookahead serve --replicas` is starting or serving the Serve app {APP_NAME!r} on this Ray"
            " cluster: stop that one first"
        ) from None


def _start(ray, serve, config: ServerConfig, settings: RaySettings, gpus: float) -> str:
    """:func:`deploy` once the cluster is checked and the app's name claimed."""
    _forget_drain()
    from rag_lookahead.serve.ray_replica import LookaheadReplica

    threads = 0 if gpus else max(1, int(settings.num_cpus))
    deployment = serve.deployment(LookaheadReplica, **deployment_options(config, settings, gpus, replica_env()))
    node_cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    sharers = memory_sharers(settings, gpus, node_cpus)
    application = deployment.bind(replica_config(local_paths_absolute(config), gpus, sharers), threads)
    try:
        serve.start(
            http_options={"host": config.host, "port": config.port}, logging_config={"log_level": _level(config)}
        )
    except Exception as err:  # the port is taken, or the host is not an address of this machine
        raise ConfigError(f"Ray Serve could not listen on {config.host}:{config.port}: {_cause(err)}") from err
    from ray.serve.api import _run

    watch = StartWatch(limit=MAX_CONSTRUCTOR_RETRIES)
    try:  # serve.run without its wait, which had no limit (see StartWatch)
        _run(
            application, _blocking=False, name=APP_NAME, route_prefix="/", logging_config={"log_level": _level(config)}
        )
        _wait_until_running(serve, watch)
    except BaseException as err:  # a replica's constructor failed (the model or the index did not load), or ^C
        why = ""
        if isinstance(err, Exception):  # where replicas were killed, Ray's own error names no cause
            why = watch.seen() or _cause(err, _replica_errors(serve))
        try:
            _delete_quietly(serve)
        except KeyboardInterrupt:  # a second ^C while deleting: the app may be left on the cluster
            raise StartAbandoned() from err
        if why:
            raise ModelLoadError(f"the Ray Serve replicas did not start: {why}") from err
        raise
    return base_url(config.host, config.port)


#: How often the start looks whether the app runs, and at Ray's actors (:class:`StartWatch`)
START_POLL_S = 1.0


def _wait_until_running(serve, watch: StartWatch) -> None:
    """Wait, as ``serve.run`` does, until the app runs; raise Ray's error where it failed, and one
    of ours once :class:`StartWatch` finds the start hopeless."""
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            raise RuntimeError(f"the Serve app {APP_NAME!r} was deleted as it started")
        if app.status == "RUNNING":
            return
        if app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {APP_NAME} failed: {app.message}")
        if watch.hopeless():
            raise ModelLoadError(watch.seen())
        time.sleep(START_POLL_S)


#: Ray Serve's name for its controller actor (namespace "serve"), and how it names our replicas' actors
_CONTROLLER_ACTOR = "SERVE_CONTROLLER_ACTOR"
_REPLICA_ACTOR_PREFIX = f"SERVE_REPLICA::{APP_NAME}#"


class StartWatch:
    """Counts, while the replicas start, the replica processes that die unasked (killed: by Ray's
    memory monitor, the kernel's OOM killer, a signal) and the restarts of Ray's Serve controller.
    Ray counts a replica's failed starts towards ``max_constructor_retry_count`` and then fails the
    app, with a message that names no cause ("Failed to update the deployments"); but where the
    controller is killed too (Ray's memory monitor killed both, under a model too big for memory),
    each new controller starts the replica again with a fresh count, and ``serve.run``, which waits
    with no limit, waited for good. Past ``limit`` of either the start is :meth:`hopeless`. It reads
    Ray's actor table from the GCS (Ray's state API needs the dashboard, which a local Ray here
    starts without)."""

    def __init__(self, limit: int) -> None:
        from ray._private import state

        self._state, self.limit = state, limit
        self._deaths: dict[str, bool] = {}  # replica actor id -> whether Ray says memory
        self._restarts = 0
        # what the cluster held before this start (an earlier app's dead replicas, a controller's
        # restarts, a controller left DEAD by `serve shutdown`): None until the GCS first answers
        self._before: tuple[dict[str, bool], dict[str, int]] | None = None
        self._update()

    def _look(self) -> tuple[dict[str, bool], dict[str, int]]:
        """(our replicas' actors that died unasked: id -> whether Ray says memory, each Serve
        controller actor's restarts: id -> count; an earlier controller stays listed, DEAD)"""
        died, restarts = {}, {}
        for actor_id, actor in self._state.actors().items():
            name = actor.get("Name") or ""
            if name == _CONTROLLER_ACTOR:
                restarts[actor_id] = int(actor.get("NumRestarts") or 0)
            elif name.startswith(_REPLICA_ACTOR_PREFIX) and actor.get("State") == "DEAD":
                memory, unasked = _how_it_died(actor.get("DeathCause"))
                if unasked:
                    died[actor_id] = memory
        return died, restarts

    def _update(self) -> None:
        try:
            died, restarts = self._look()
        except Exception:  # noqa: BLE001 - the GCS did not answer this once: the last count stands
            return
        if self._before is None:  # nothing is counted before the cluster's state before this start is known
            self._before = died, restarts
        dead_before, restarts_before = self._before
        self._deaths = {k: v for k, v in died.items() if k not in dead_before}
        self._restarts = sum(max(0, n - restarts_before.get(k, 0)) for k, n in restarts.items())

    def hopeless(self) -> bool:
        """Whether more than ``limit`` replicas died as they started, or the controller restarted as often."""
        self._update()
        return len(self._deaths) > self.limit or self._restarts > self.limit

    def seen(self) -> str:
        """What killed the start so far, in words ("" where nothing did)."""
        self._update()
        deaths, restarts = len(self._deaths), self._restarts
        controller = f"Ray's Serve controller was killed {restarts} times" if restarts else ""
        if any(self._deaths.values()):
            what = f"Ray's memory monitor killed a replica's process {deaths} times as it started (out of memory)"
        elif deaths:
            what = (
                f"a replica's process was killed {deaths} times as it started (by the kernel's OOM killer, "
                "too little memory for the model? or by a signal)"
            )
        else:
            return f"{controller} as the replicas started (out of memory?)" if restarts else ""
        return f"{what}; {controller} too" if restarts else what


def _how_it_died(cause) -> tuple[bool, bool]:
    """(whether Ray says memory, whether it died unasked: not by ``ray.kill``, which Serve uses to
    stop a replica whose constructor raised) of an actor's DeathCause (Ray's protobuf)."""
    if cause is None:
        return False, False
    kind = cause.WhichOneof("context")
    if kind == "oom_context":
        return True, True
    if kind != "actor_died_error_context":
        return False, False
    context = cause.actor_died_error_context
    unasked = context.reason in (context.WORKER_DIED, context.NODE_DIED)
    return unasked and "running low on memory" in context.error_message, unasked


#: Ray's key-value store (its GCS), namespace of the drain: the driver sets DRAIN_KEY to the drain's
#: seconds, each replica's engine drains, and each writes DRAINED_PREFIX + its id once it is idle
KV_NAMESPACE = "rag_lookahead"
DRAIN_KEY = b"drain"
DRAINED_PREFIX = b"drained:"


def undeploy() -> None:
    """Stop this app's replicas at once (Ray lets each finish what it runs for ``drain_seconds``);
    other Serve apps keep running. For a shutdown that keeps answering meanwhile, see :func:`drain`."""
    ray, serve = import_ray()
    serve.delete(APP_NAME)
    _forget_drain()
    claim = _CLAIMS.pop(APP_NAME, None)
    if claim is not None:
        ray.kill(claim)


#: Said where this node's raylet died on a cluster that outlives the command: replicas on other nodes go on
_MAY_BE_LEFT = (
    f" (on the cluster, the Serve app {APP_NAME!r} and its replicas on other nodes may be left:"
    " `serve shutdown` removes it)"
)
#: How long the drain waits for Ray to delete the app once the replicas are idle (it took ~3 s)
UNDEPLOY_WAIT_S = 30.0
#: A question to Ray unanswered for longer than this is Ray not answering: the drain ends at its
#: deadline, or at once after a second Ctrl-C (Ray cannot tell it whether the replicas are idle)
RAY_SILENT_S = 1.0
#: How long the drain waits for Ray's head (its GCS) to take the drain's key: one that has not by
#: then is going away too (a signal to the whole process group reaches it; it still took connections)
RAY_HEAD_WAIT_S = 3.0


def drain(seconds: float, hurry: threading.Event | None = None, delete: bool = True) -> bool:
    """Drain every replica, then stop them: each replica's engine stops admitting (new requests get
    the one-process server's 503 ``shutting_down``, ``/health`` says "draining") and fails what is
    still running after ``seconds``; once every replica is idle, or ``seconds`` and a grace have
    passed, the app is deleted. (Deleting first removed the route, so clients got 404 "not found",
    which they do not retry, and requests still running were cut off without an error.) Once
    ``hurry`` is set (a second Ctrl-C) the replicas end what still runs at once. ``delete=False``
    leaves the idle app to a ``ray.shutdown`` of the local Ray this process started: deleting it
    first stops the replicas while Ray's proxy still answers, with a plain-text 404 for ~3 s.

    Ray's answers are waited for within the drain's deadline only, and the deletion for
    :data:`UNDEPLOY_WAIT_S`: once this node's raylet had died, ``serve.status()`` blocked for good
    and the drain with it, deaf to every signal. A raylet found gone ends the drain at once; a Ray
    that does not answer ends it at the deadline, or at once after a second Ctrl-C (``hurry``);
    each with a line saying so. A question Ray never answered still waits in its thread
    (:meth:`ray_probes.RayCall.unanswered`): ``ray.shutdown()`` under it crashes the process.

    False where Ray's head (its GCS) fails or does not answer within :data:`RAY_HEAD_WAIT_S` (a
    signal to the whole process group reached it too: it still takes connections while it shuts
    down, and Ray's client then waited 60 s for it and aborted the process, exit 1): nothing to
    drain, and the caller must not ``ray.shutdown()`` (it waits on the head as well)."""
    from ray.experimental.internal_kv import _internal_kv_list, _internal_kv_put

    from rag_lookahead.serve.app import CLOSE_GRACE_SECONDS

    ray, serve = import_ray()
    raylet = ray_probes.RayletWatch.of_driver(ray)

    # a cluster this command joined is no child of its process group: a slow head there is only slow
    head_wait = UNDEPLOY_WAIT_S if delete else RAY_HEAD_WAIT_S

    def head_answers(value: bytes) -> bool:
        """Whether Ray's head took DRAIN_KEY = ``value`` in time; if not, says so."""
        try:
            ray_probes.RayCall(lambda: _internal_kv_put(DRAIN_KEY, value, namespace=KV_NAMESPACE)).result(head_wait)
        except Exception as err:  # noqa: BLE001 - Unanswered, or Ray's RpcError from a head shutting down
            _log_head_gone(err, head_wait, delete)
            return False
        return True

    if not head_answers(str(float(seconds)).encode()):
        return False
    deadline = time.monotonic() + seconds + 2 * CLOSE_GRACE_SECONDS

    def progress() -> tuple[int, int]:
        """(replicas that said they are idle, replicas running)"""
        return len(_internal_kv_list(DRAINED_PREFIX, namespace=KV_NAMESPACE)), _running_replicas(serve)

    asked: ray_probes.RayCall | None = None  # the question to Ray in flight, if any
    hurried = False
    while True:
        if hurry is not None and hurry.is_set() and not hurried:
            hurried = True
            if not head_answers(b"0"):
                return False
            deadline = min(deadline, time.monotonic() + 2 * CLOSE_GRACE_SECONDS)
        if raylet is not None and raylet.gone():
            log.warning(
                "Ray's raylet on this node (%s) is gone: nothing left to drain here%s",
                raylet.address,
                _MAY_BE_LEFT if delete else "",
            )
            return True
        silent = 0.0 if asked is None else time.monotonic() - asked.started
        if time.monotonic() >= deadline or (hurried and silent > RAY_SILENT_S):
            if silent > RAY_SILENT_S:
                log.warning(
                    "Ray Serve has not said in %.0f s which replicas still run (its controller or node is gone?): "
                    "the drain ends here",
                    silent,
                )
            break
        asked = asked or ray_probes.RayCall(progress)
        try:
            drained, running = asked.result(0.1)
        except ray_probes.Unanswered:
            continue
        except Exception as err:  # noqa: BLE001 - Ray's RpcError: its head went away under the question
            _log_head_gone(err, head_wait, delete)
            return False
        asked = None
        if drained >= running:
            break
        time.sleep(0.1)
    if delete:  # after a second Ctrl-C, no longer than the replicas had to end their requests
        _undeploy_within(2 * CLOSE_GRACE_SECONDS if hurried else UNDEPLOY_WAIT_S)
    return True


def _log_head_gone(err: BaseException, waited: float, joined: bool) -> None:
    """The drain's line where Ray's head failed it or did not answer within ``waited`` seconds:
    a local Ray going away with this command (the signal reached its whole process group), or a
    cluster this command joined that no longer answers (the app may be left there)."""
    why = f"did not answer in {waited:g} s" if isinstance(err, ray_probes.Unanswered) else f"failed ({first_line(err)})"
    whose = (
        "the cluster's head does not answer"
        if joined
        else "Ray's own processes are going away too (the signal reached them?)"
    )
    log.warning("Ray's head (its GCS) %s: %s: nothing to drain%s", why, whose, _MAY_BE_LEFT if joined else "")


def _undeploy_within(seconds: float) -> None:
    """:func:`undeploy`, given up after ``seconds`` with a line saying the app may be left."""
    try:
        ray_probes.RayCall(undeploy).result(seconds)
    except ray_probes.Unanswered:
        log.warning(
            "Ray Serve has not deleted the app in %.0f s: it may be left on the Ray cluster; "
            "`serve shutdown` or serve.delete(%r) removes it",
            seconds,
            APP_NAME,
        )


def _running_replicas(serve) -> int:
    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except KeyError:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in deployments.values())


def _forget_drain() -> None:
    """Clear the drain's keys (a new deploy must not find an earlier one's and drain at once)."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

    if _internal_kv_initialized():
        for key in (DRAIN_KEY, DRAINED_PREFIX):
            _internal_kv_del(key, del_by_prefix=True, namespace=KV_NAMESPACE)


def run_on_ray(config: ServerConfig, settings: RaySettings) -> NoReturn:
    """Deploy, serve until SIGTERM or SIGINT, then drain the replicas, disconnect from Ray and end
    as the one-process server does (:func:`_end_by`): killed by SIGTERM (a shell's 143), exit 130
    after SIGINT. As there, a second Ctrl-C ends the drain at once and a second SIGTERM does not.
    A signal while the replicas start abandons them (they are deleted) rather than wait. Where this
    node's raylet dies meanwhile, :class:`RayNodeLost` (exit 1) within a few seconds: Ray's driver
    is not told, and the command had gone on running while its port refused every connection."""
    ray, _ = import_ray()
    logging.basicConfig(level=_level(config), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_port(config.port)
    own_ray = not ray.is_initialized() and _starts_local_ray()
    stop, serving, hurry = threading.Event(), threading.Event(), threading.Event()
    closing = threading.Event()  # ray.shutdown() runs: a signal then must not cut it short
    received: list[int] = []  # the signals, in order: the command ends by the last (see _end_by)

    def on_signal(signum, frame) -> None:
        received.append(signum)
        if stop.is_set() and signum == signal.SIGINT:
            hurry.set()  # a second Ctrl-C while draining: end what still runs (a second SIGTERM does not)
        stop.set()
        if not serving.is_set() and not closing.is_set():
            raise KeyboardInterrupt  # out of serve.run, which may wait minutes for the models

    def listen() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    listen()
    abandoned = False
    try:
        # at warning and above the replicas' logs stay in Ray's log folder (a failed start is pages of them)
        options = {"logging_level": _level(config), "log_to_driver": _level(config) in ("DEBUG", "INFO")}
        arrived = _connect_holding_signals(ray, options)  # puts our handlers back after ray.init's
        logging.getLogger("ray.serve").setLevel(_level(config))  # Serve's driver-side logger keeps INFO otherwise
        if arrived & {signal.SIGINT, signal.SIGTERM}:  # held until the local Ray was whole: ray.shutdown() stops it
            stop.set()  # a signal now is a second one
            raise KeyboardInterrupt
        base = deploy(config, settings)  # deletes what it started if it fails or is interrupted
        serving.set()
        log.info("serving %s at %s on Ray Serve (%s)", config.model_name, base, _describe(settings))
        raylet = ray_probes.RayletWatch.of_driver(ray)
        while not stop.wait(1.0):
            if raylet is not None and raylet.gone():
                raise RayNodeLost(
                    f"Ray's raylet on this node ({raylet.address}) died (killed, or out of memory?): the Ray Serve "
                    "proxy and replicas it ran went with it and this command lost Ray; start `serve` again"
                    + ("" if own_ray else _MAY_BE_LEFT)
                )
        if not _gcs_answers(ray):
            log.warning("shutting down: Ray's own processes are gone (the signal reached them too): nothing to drain")
        else:
            log.info("shutting down: draining the replicas for up to %g s", config.drain_seconds)
            drained = drain(config.drain_seconds, hurry, delete=not own_ray)  # a local Ray goes down whole below
            # Ray's head or a question of the drain did not answer: no ray.shutdown() waiting on them
            if not drained or ray_probes.RayCall.unanswered():
                _exit_leaving_ray(ray, received[-1])
    except StartAbandoned:
        log.warning(
            "interrupted again while deleting the half-started replicas: on a Ray cluster that outlives this "
            "command (RAY_ADDRESS, or one `ray start` began) the Serve app %r may be left; "
            "`serve shutdown` or serve.delete(%r) removes it",
            APP_NAME,
            APP_NAME,
        )
        abandoned = True
    except KeyboardInterrupt:
        log.info("interrupted while the replicas started: deleted them")
        abandoned = True
    finally:
        # a signal in ray.shutdown() (a second Ctrl-C after a held first one) cut it short: exit 1, Ray left
        closing.set()
        ray.shutdown()
    if abandoned:  # a start that never served is no clean exit (it was 0); one process exits 130 too
        raise SystemExit(130)
    _end_by(received[-1])  # only a signal ends the serving loop without an exception


def _end_by(signum: int, leave: bool = False) -> NoReturn:
    """End after a drain as the one-process server does, where uvicorn raises the last signal it
    got again once it has shut down: killed by SIGTERM (a shell's 143, which systemd counts as a
    clean stop, where an exit status of 143 is a failure to it), exit 130 after SIGINT. (Until
    2026-12-07 ``--replicas`` exited 0 after either.) ``leave``: at once, without Python's exit
    and its atexit hooks (see :func:`_exit_leaving_ray`)."""
    if signum == signal.SIGINT and not leave:
        raise SystemExit(130)
    logging.shutdown()
    if signum != signal.SIGINT:
        flush_output()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # its default action ends the process here
    leave_now(128 + signum)


def _exit_leaving_ray(ray, signum: int) -> NoReturn:
    """End now by ``signum`` (:func:`_end_by`), without ``ray.shutdown()`` and without Python's
    exit (whose atexit hooks include Ray's ``ray.shutdown()``): a question of the drain that Ray
    never answered (a frozen Serve controller, a dead node) still waits inside Ray's core worker,
    which ``ray.shutdown()`` tears down under it (see :meth:`ray_probes.RayCall.unanswered`); the
    command then sometimes died after its last line, by SIGSEGV (-11) where it should have ended
    by its signal. The local Ray this command started is stopped first, as ``ray.shutdown()``
    stops it; a cluster the command joined sees its driver end, as when one is killed."""
    node = getattr(ray._private.worker, "_global_node", None)  # the local Ray ray.init started, if any
    if node is not None:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
    _end_by(signum, leave=True)


def _gcs_answers(ray, timeout: float = 2.0) -> bool:
    """Whether Ray's GCS (its head process) still takes connections. A SIGTERM sent to the whole
    process group (systemd's default stop, ``timeout``, ``kill -- -PGID``) also ends the local
    Ray this command started: draining then waited 60 s for the dead GCS and Ray's client aborted
    the process (exit 1, the replicas' requests never drained either way)."""
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - no address to judge by: drain as before
        return True
    return ray_probes.connect_error(address, timeout) is None


def _connect_holding_signals(ray, options: Mapping[str, Any]) -> set[int]:
    """:func:`_connect` with SIGINT and SIGTERM held until ``ray.init`` returns: the signals that
    arrived meanwhile; a second one raises KeyboardInterrupt at once. Why: one raised inside
    ``ray.init`` (a KeyboardInterrupt of ours, or ``sys.exit(15)`` from the SIGTERM handler
    ray.init installs) left a half-started local Ray that ``ray.shutdown()`` does not know: its
    dashboard and runtime-env agents ran on for ~60 s, and SIGTERM exited 15 with no line of ours;
    and where it landed inside one of ray.init's fork hooks the exception was dropped, and the
    replicas started and served on. Whatever is still raised there (that second signal) ends the
    processes ray.init started, by their pids (:func:`_end_new_descendants`), where it left no
    local Ray for ``ray.shutdown()`` to stop."""
    arrived: list[int] = []

    def hold(signum, frame) -> None:
        arrived.append(signum)
        if len(arrived) > 1:
            raise KeyboardInterrupt  # a second signal: no longer wait for Ray

    utils = ray._private.utils
    rays_own = getattr(utils, "set_sigterm_handler", None)
    before = _descendants()
    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if rays_own is not None:  # ray.init's SIGTERM handler (sys.exit) would replace ours meanwhile
            utils.set_sigterm_handler = lambda handler: None
        _connect(ray, options)
    except (KeyboardInterrupt, SystemExit):
        if getattr(ray._private.worker, "_global_node", None) is None:  # ray.shutdown() would not stop them
            _end_new_descendants(before)
        if not arrived:
            raise
        raise KeyboardInterrupt from None
    finally:
        if rays_own is not None:
            utils.set_sigterm_handler = rays_own
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return set(arrived)


def _descendants() -> dict[int, float]:
    """This process's descendants: pid -> start time (psutil, which Ray ships)."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found[child.pid] = child.create_time()
    return found


def _end_new_descendants(before: Mapping[int, float], grace: float = 3.0) -> None:
    """End the descendants of this process that were not among ``before`` (pid -> start time):
    SIGTERM, then SIGKILL to those still running after ``grace`` seconds."""
    import psutil

    new = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if before.get(child.pid) != child.create_time():
                new.append(child)
    for child in new:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(new, timeout=grace)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _level(config: ServerConfig) -> str:
    """The ``logging`` level name of ``--log-level`` (uvicorn's "trace" is DEBUG here)."""
    return "DEBUG" if config.log_level == "trace" else config.log_level.upper()


def _check_port(port: int) -> None:
    if port == 0:
        raise ConfigError("--port 0 (any free port) does not work with --replicas: Ray's proxy would not say which")


def _connect(ray, options: Mapping[str, Any]) -> None:
    """``ray.init`` (a local Ray, or the cluster ``RAY_ADDRESS`` names), its failure as one line."""
    if ray.is_initialized():
        return
    _check_reachable(_ray_address())
    try:
        # no dashboard for a local Ray: nobody reads it, and its 9 processes left a /tmp/pymp-* folder
        # behind per run (ignored when joining a cluster)
        ray.init(**{"include_dashboard": False, **dict(options)})
    except Exception as err:
        address = os.environ.get("RAY_ADDRESS")
        where = f"reach the Ray cluster at RAY_ADDRESS={address}" if address else "start a local Ray"
        raise ConfigError(f"could not {where}: {_auth_refusal(err) or _cause(err)}") from err


def _auth_refusal(err: BaseException) -> str:
    """What to do where ``ray.init`` failed because the cluster's token authentication refused this
    driver (Ray's AuthenticationError, "InvalidAuthToken", is only in the text of the error its
    ConnectionError wraps); else "". Ray said only "Failed to connect to Ray cluster at ..."."""
    text = ""
    for _ in range(8):  # the error and what it wraps
        if err is None:
            break
        text += f"{type(err).__name__}: {err}\n"
        err = err.__cause__ or err.__context__
    if "InvalidAuthToken" not in text and "AuthenticationError" not in text:
        return ""
    where = "~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN"
    if "no authentication token was found" in text:  # Ray's own check, before it reaches the cluster
        return f"RAY_AUTH_MODE=token is set but no Ray token was found: put the cluster's token in {where}"
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        return (
            "the cluster uses Ray's token authentication and this command sent no token: set RAY_AUTH_MODE=token"
            f" (Ray reads the cluster's token from {where})"
        )
    return f"the cluster's token authentication refused the token this command sent: put the cluster's token in {where}"


def _starts_local_ray() -> bool:
    """Whether ``ray.init`` here starts a Ray of its own (which goes down with this command), not
    join one: RAY_ADDRESS, or a cluster ``ray start`` began on this machine, is joined."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address(_ray_address() or None) is None
    except Exception:  # noqa: BLE001 - an address Ray cannot read: not ours (``_connect`` says why)
        return False


def _ray_address() -> str:
    """``$RAY_ADDRESS`` without surrounding spaces, put back so in this process's environment (and
    removed there where blank), which ``ray.init`` reads as it is: a blank one counted as unset
    for our checks (a local Ray), and ``ray.init`` then refused it ("Invalid address format")."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        os.environ["RAY_ADDRESS"] = address
    else:
        os.environ.pop("RAY_ADDRESS", None)
    return address


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse a ``host:port`` RAY_ADDRESS where nothing listens, or where what listens is not
    Ray (a web server, the dashboard's 8265, another ``serve``): ``ray.init`` retried either for
    ~14 minutes, deaf to Ctrl-C (its C++ connect blocks; our handlers come after it). Ray's GCS
    is a gRPC server, so it must answer HTTP/2's handshake (skipped under RAY_USE_TLS)."""
    if not address or address in ("auto", "local") or "://" in address:
        return  # Ray looks these up itself, and fails fast
    plain = os.environ.get("RAY_USE_TLS", "0").strip().lower() not in ("1", "true")
    err = ray_probes.connect_error(address, timeout, grpc=plain)
    if isinstance(err, ray_probes.NotGrpc):
        raise ConfigError(
            f"RAY_ADDRESS={address} is not a Ray cluster: something listens there but does not answer as Ray's "
            "GCS does (gRPC); give the head's GCS address (`ray start --head` prints it, port 6379 by default), "
            "not the dashboard's port 8265 or another server (a cluster with TLS: set RAY_USE_TLS=1)"
        ) from None
    if err is not None:
        raise ConfigError(
            f"could not reach the Ray cluster at RAY_ADDRESS={address}: nothing answers there "
            f"({err.strerror or type(err).__name__}); start it with `ray start --head`, or unset RAY_ADDRESS "
            "for a local Ray"
        ) from None


def _check_serve_free(serve, config: ServerConfig) -> None:
    """On a cluster where Ray Serve already runs (another ``serve --replicas``, or one that has
    exited: Serve's proxy outlives it), its app would be replaced and its address kept whatever
    ``--host``/``--port`` say; refuse both instead of serving elsewhere than we report."""
    if APP_NAME in serve.status().applications:
        raise ConfigError(
            f"this Ray cluster already runs a Serve app named {APP_NAME!r} (another `rag_lookahead serve "
            f"--replicas`, or one interrupted while it started): stop that one first (`serve shutdown`, or "
            f"serve.delete({APP_NAME!r}) for this app alone)"
        )
    running = _serve_address()
    if running is None:  # Serve starts its proxy here: anything already on the port is not ours
        from rag_lookahead.serve.command import listening_socket

        # Ray's proxy binds with SO_REUSEPORT, so a second local Ray's proxy would share the port with
        # the first (another `serve --replicas`) and the two servers would split the traffic
        listening_socket(config.host, config.port).close()
    if running is not None and running != (config.host, config.port):
        host, port = running
        raise ConfigError(
            f"Ray Serve already runs on this Ray cluster and listens on {host}:{port}, which cannot change "
            f"while it runs: pass --host {host} --port {port}, or stop it first (`serve shutdown`)"
        )


def _serve_address() -> tuple[str, int] | None:
    """``(host, port)`` Ray Serve's proxies listen on, None when Serve is not running (Ray 2.60)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    options = client.get_serve_details().get("http_options") or {}
    return str(options.get("host")), int(options.get("port"))


def _replica_errors(serve) -> str:
    """What Ray says of our app's deployments (a replica's traceback is there, not in the error)."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - only a better message is lost
        return ""
    return "" if app is None else "\n".join(d.message for d in app.deployments.values())


class RayNodeLost(RagLookaheadError):
    """This node's raylet died while serving: Ray's driver is not told, and served nothing on."""


class StartAbandoned(KeyboardInterrupt):
    """Interrupted while deleting replicas that an interrupt stopped starting: they may be left."""


def _delete_quietly(serve) -> None:
    try:
        serve.delete(APP_NAME)
    except Exception as err:  # nothing was created yet, or Ray is going away
        log.debug("could not delete the half-started app: %s", err)


def _cause(err: BaseException, details: str = "") -> str:
    """The line of a Ray error (and of ``details``, Ray's messages about it) that says why: the
    replica's own error (ours, or the last ``SomethingError: ...`` line of a remote traceback Ray
    wraps), else the error's first line."""
    lines = [line.strip() for line in f"{err}\n{details}".splitlines() if line.strip()]
    for pattern in (_OUR_ERROR, _ANY_ERROR):
        found = [m.group(1) for line in lines if (m := pattern.match(line))]
        if found:
            return found[-1]
    return first_line(err)


_OUR_ERROR = re.compile(r"^(?:rag_lookahead\.errors\.)?(?:ConfigError|ModelLoadError|IndexLoadError|InputError): (.+)$")
_ANY_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): (.+)$")


def _describe(settings: RaySettings) -> str:
    if settings.max_replicas is None:
        return f"{settings.replicas} replicas"
    return f"{settings.replicas} replicas, autoscaling {settings.lowest}..{settings.max_replicas}"


def _check_fits(settings: RaySettings, gpus: float, resources: Mapping[str, float]) -> None:
    """Ray would wait forever for replicas the cluster cannot hold: say so instead. The replicas
    that must fit are those the deploy starts (``replicas``; autoscaling may go below it later)."""
    need = {"CPU": settings.replicas * settings.num_cpus, "GPU": settings.replicas * gpus}
    for kind, amount in need.items():
        have = resources.get(kind, 0.0)
        if amount > have:
            per = settings.num_cpus if kind == "CPU" else gpus
            if kind == "CPU":
                advice = " (lower --replica-cpus or --replicas)"
            else:  # with no GPU at all, fewer replicas cannot help
                advice = " (lower --replicas)" if have else " (run on the CPU: --device cpu)"
            raise ConfigError(
                f"{settings.replicas} replicas x {per:g} {kind} need {amount:g} {kind}s; the Ray cluster has {have:g}"
                + advice
            )
