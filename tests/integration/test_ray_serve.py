"""``rag_lookahead serve --replicas N``: two CPU replicas of the tiny Qwen2 on Ray Serve, behind Ray's proxy.

Ray is the optional extra ``rag-lookahead[ray]``: without it the tests that start Ray are skipped
(the settings, the routing key and the missing-Ray error are checked either way). One local Ray
(2 CPUs, no dashboard, an 80 MiB object store) serves every Ray test here; each replica loads the
tiny model from a folder, as ``serve --model FOLDER`` would. ``python -m rag_lookahead.serve``
with the same settings runs first, in its own process: its texts are the expected ones, and its
time for the 200-request load is the baseline the two replicas are compared with (printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

try:
    import ray
    from ray import serve
except ImportError:
    ray = serve = None

from remote_models import remote_folder
from test_server import LOOKAHEAD, metric, parse_sse, stream_text, tiny_prompts, tokenizer
from tiny_models import tiny_model

from rag_lookahead.errors import ConfigError
from rag_lookahead.serve import ServerConfig
from rag_lookahead.serve.ray_deploy import (
    APP_NAME,
    REPLICA_HEADER,
    RaySettings,
    _running_replicas,
    deploy,
    deployment_options,
    gpus_per_replica,
    import_ray,
    replica_config,
    settings_from_args,
    undeploy,
)

needs_ray = pytest.mark.skipif(ray is None, reason="Ray Serve is the optional extra: pip install 'rag-lookahead[ray]'")

PROMPTS = tiny_prompts(6)
BUDGETS = [8, 12, 16, 24, 32, 20]
KINDS = ("plain", "stream", "drop", "plain", "stream")
COMPLETED = "rag_lookahead_requests_completed_total"
CANCELLED = "rag_lookahead_requests_cancelled_total"


# ---------------------------------------------------------------- helpers


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port outside the kernel's ephemeral range (32768-60999 on Linux) and above Ray's
    worker ports (10002-19999): Ray opens dozens of connections from the ephemeral range before
    its proxy binds the port, so one picked there (port 0) could be taken by then."""
    rng = random.Random()
    while True:
        port = rng.randint(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


async def complete(client: httpx.AsyncClient, i: int, kind: str = "plain", headers: dict | None = None) -> dict:
    """One completion of ``PROMPTS[i]``: its status, text, id and replica; a stream dropped after its
    first event ("drop") or cut short by the server ("truncated") has no text."""
    body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": BUDGETS[i], "stream": kind != "plain"}
    out = {"i": i, "kind": kind}
    if kind == "plain":
        r = await client.post("/v1/completions", json=body, headers=headers)
        out.update(status=r.status_code, replica=r.headers.get(REPLICA_HEADER))
        if r.status_code == 200:
            out.update(text=r.json()["choices"][0]["text"], id=r.json()["id"])
        return out
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        out.update(status=r.status_code, replica=r.headers.get(REPLICA_HEADER))
        raw = ""
        async for chunk in r.aiter_text():
            raw += chunk
            if kind == "drop" and "\n\n" in raw:
                return out  # leave after the first event
    if r.status_code == 200 and not raw.rstrip().endswith("data: [DONE]"):
        return {**out, "status": "truncated"}
    if r.status_code == 200:
        events = parse_sse(raw)
        out.update(text=stream_text(events, chat=False)[0], id=events[0]["id"])
    return out


async def load(base: str, count: int, clients: int) -> tuple[list[dict], float]:
    """``count`` requests (plain, streamed, dropped streams) from ``clients`` concurrent clients; the seconds taken."""
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def one(n: int) -> dict:
            async with gate:
                return {"n": n, **await complete(client, n % len(PROMPTS), KINDS[n % len(KINDS)])}

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(count))), 300)
        return results, time.perf_counter() - start


def check_load(results: list[dict], expected: dict[int, str]) -> None:
    """Nothing lost or duplicated; every finished text is the single-process one."""
    assert sorted(r["n"] for r in results) == list(range(len(results)))
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    finished = [r for r in results if r["kind"] != "drop"]
    assert len({r["id"] for r in finished}) == len(finished), "a response id was reused"
    for r in finished:
        assert r["text"] == expected[r["i"]], (r["n"], r["kind"], r.get("replica"))


def tokens_per_second(results: list[dict], seconds: float) -> float:
    return sum(BUDGETS[r["i"]] for r in results if r["kind"] != "drop") / seconds


def probe_replicas(base: str, want: int = 2, tries: int = 64) -> dict[str, str]:
    """A session id leading to each replica: replica id -> session id (sessions hash to replicas)."""
    found: dict[str, str] = {}
    with httpx.Client(base_url=base, timeout=30) as client:
        for k in range(tries):
            r = client.get("/health", headers={"X-Session-Id": f"probe-{k}"})
            if r.status_code == 200:
                found.setdefault(r.headers[REPLICA_HEADER], f"probe-{k}")
            if len(found) >= want:
                break
    return found


def replica_metrics(base: str, sessions: dict[str, str]) -> dict[str, str]:
    """Each replica's /metrics text, reached through its session id."""
    out = {}
    with httpx.Client(base_url=base, timeout=30) as client:
        for replica, session in sessions.items():
            r = client.get("/metrics", headers={"X-Session-Id": session})
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica
            out[replica] = r.text
    return out


# ---------------------------------------------------------------- without starting Ray


def test_settings_and_deployment_options():
    for bad, words in [
        (dict(replicas=0), "replicas must be an integer >= 1"),
        (dict(min_replicas=1), "min_replicas needs max_replicas"),
        (dict(replicas=5, max_replicas=4), "within min_replicas..max_replicas"),
        (dict(num_cpus=-1), "num_cpus must be a number"),
        (dict(num_gpus=True), "num_gpus must be a number"),
    ]:
        with pytest.raises(ConfigError, match=words):
            RaySettings(**bad)
    assert RaySettings(num_cpus=0, num_gpus=1).num_cpus == 0  # a GPU replica needs no CPU of its own
    assert settings_from_args({"replicas": 0, "port": 8000}) is None
    for alone in ({"max_replicas": 3}, {"max_replicas": 0}, {"replica_cpus": -5.0}, {"replica_cpus": 2.0}):
        with pytest.raises(ConfigError, match="needs --replicas"):  # was silently ignored (0 and -5 too)
            settings_from_args({"replicas": 0, **alone})
    assert settings_from_args({"replicas": 0, "replica_cpus": 1.0}) is None  # the option's default
    for flags, words in [  # named as the command line names them (they said replicas, num_cpus)
        ({"replicas": -1}, "--replicas must be an integer >= 1"),
        ({"replicas": 2, "replica_cpus": 0.0}, "--replica-cpus must be > 0 for CPU replicas"),
        ({"replicas": 2, "replica_cpus": 2000.0}, "--replica-cpus must be a number in 0..1024"),
        ({"replicas": 4, "max_replicas": 2}, r"--max-replicas \(2\) is below --replicas \(4\)"),
    ]:
        with pytest.raises(ConfigError, match=words):
            settings_from_args(flags)
    assert settings_from_args({"replicas": 2, "max_replicas": 2}).most_replicas == 2  # not below: accepted
    config = ServerConfig(max_batch_size=8, max_queue=4, drain_seconds=10)
    fixed = deployment_options(config, RaySettings(replicas=2), 0.0)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 12  # two batches, but no more than a batch and the queue
    # Ray's router counts requests still being assigned as queued: a burst at idle replicas was dropped
    assert fixed["max_queued_requests"] == 4 + 2 * 12 and fixed["graceful_shutdown_timeout_s"] > 10
    assert fixed["backpressure_config"].status_code == 429 and fixed["backpressure_config"].retry_after_s == 1
    assert fixed["request_router_config"] == {"request_router_class": "rag_lookahead.serve.ray_router.SessionRouter"}
    # a replica whose engine died kept answering 503 for 20-25 s at Ray's default 10 s period
    assert fixed["health_check_period_s"] <= 2
    scaling = deployment_options(config, settings_from_args({"replicas": 2, "max_replicas": 4, "replica_cpus": 0.5}), 0)
    assert "num_replicas" not in scaling and scaling["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert scaling["autoscaling_config"] == {
        "min_replicas": 2,
        "initial_replicas": 2,
        "max_replicas": 4,
        "target_ongoing_requests": 8,
    }
    assert scaling["max_queued_requests"] == 4 + 4 * 12  # the most replicas that may run, each full
    started = deployment_options(config, RaySettings(replicas=3, min_replicas=1, max_replicas=4), 0)
    assert started["autoscaling_config"]["initial_replicas"] == 3  # starts with --replicas, not the fewest
    assert started["autoscaling_config"]["min_replicas"] == 1


def test_gpu_per_replica_when_the_device_is_cuda():
    cpu, cuda1, unset = ServerConfig(device="cpu"), ServerConfig(device="cuda:1"), ServerConfig()
    default = RaySettings()
    assert gpus_per_replica(cpu, default, cluster_gpus=8) == 0
    assert gpus_per_replica(cuda1, default, cluster_gpus=8) == 1
    assert gpus_per_replica(unset, default, cluster_gpus=8) == 1 and gpus_per_replica(unset, default, 0) == 0
    assert gpus_per_replica(ServerConfig(device_map="auto"), default, cluster_gpus=8) == 0  # accelerate places it
    assert gpus_per_replica(cpu, RaySettings(num_gpus=0.5), cluster_gpus=8) == 0.5
    assert replica_config(cuda1, 1).device == "cuda"  # Ray shows a replica only its own GPU
    assert replica_config(cuda1, 0.5).device == "cuda"  # on a fraction of a GPU too: cuda:1 named none there
    assert replica_config(unset, 0).device == "cpu" and replica_config(cpu, 0) is cpu


def test_a_cluster_without_gpus_is_told_to_run_on_the_cpu():
    """`--device cuda` on a cluster with no GPU advised "lower --replicas", which cannot help."""
    from rag_lookahead.serve.ray_deploy import _check_fits

    with pytest.raises(ConfigError, match=r"has 0 \(run on the CPU: --device cpu\)$"):
        _check_fits(RaySettings(replicas=1), 1.0, {"CPU": 2.0})
    with pytest.raises(ConfigError, match=r"need 2 GPUs; the Ray cluster has 1 \(lower --replicas\)$"):
        _check_fits(RaySettings(replicas=2), 1.0, {"CPU": 4.0, "GPU": 1.0})
    _check_fits(RaySettings(replicas=1, max_replicas=4), 0.0, {"CPU": 2.0})  # those started must fit, not the most
    # the deploy starts `replicas`, not the fewest autoscaling allows: 3 x 1 CPU waited forever on 2
    with pytest.raises(ConfigError, match=r"^3 replicas x 1 CPU need 3 CPUs; the Ray cluster has 2 "):
        _check_fits(RaySettings(replicas=3, min_replicas=1, max_replicas=4), 0.0, {"CPU": 2.0})


def test_ray_start_up_errors_are_one_line_with_their_cause():
    """Ray wraps a replica's error in pages of traceback whose first line says only that the deploy
    failed; the line printed is the replica's own error (the measured bug: "Failed to update the
    deployments" for a model folder that does not exist)."""
    from rag_lookahead.serve.ray_deploy import _cause

    wrapped = (
        "Deploying application rag_lookahead failed: Failed to update the deployments ['LookaheadReplica'].\n"
        'Traceback (most recent call last):\n  File "replica.py", line 9, in __init__\n'
        "    raise ModelLoadError(...)\n"
        "rag_lookahead.errors.ModelLoadError: model folder /nowhere does not exist\n"
    )
    assert _cause(RuntimeError(wrapped)) == "model folder /nowhere does not exist"
    bind = "Failed to start the proxy.\nTraceback ...\nOSError: [Errno 98] Address already in use"
    assert _cause(RuntimeError(bind)) == "[Errno 98] Address already in use"
    assert _cause(RuntimeError("no cause given")) == "no cause given"
    chained = "ValueError: while reading the config\nThe above exception was the direct cause of:\nOSError: disk full"
    assert _cause(RuntimeError(chained)) == "disk full"  # the error raised last is the one that ended the start
    ours_then_ray = wrapped + "ray.exceptions.RayActorError: The actor died unexpectedly before finishing this task."
    assert _cause(RuntimeError(ours_then_ray)) == "model folder /nowhere does not exist"  # ours says why


def test_replicas_on_one_node_divide_the_default_kv_budget(tokenizer):
    """Each CPU replica took a quarter of the node's free RAM as its KV budget, so 4 replicas on one
    node budgeted all of it and 8 twice as much."""
    from rag_lookahead.serve.admission import default_token_budget
    from rag_lookahead.serve.ray_deploy import memory_sharers, replica_config

    assert memory_sharers(RaySettings(replicas=4), 0.0, [16.0]) == 4
    assert memory_sharers(RaySettings(replicas=8, num_cpus=4), 0.0, [16.0, 8.0]) == 4  # 4 fit the largest node
    assert memory_sharers(RaySettings(replicas=2), 1.0, [16.0]) == 1  # a GPU each
    assert memory_sharers(RaySettings(replicas=4), 0.25, [16.0]) == 4  # a quarter of one GPU each
    assert memory_sharers(RaySettings(replicas=2), 0.25, [16.0]) == 2  # no more than the replicas asked for
    config = ServerConfig(max_queue=1_000_000, max_prompt_tokens=1_000_000)  # no ceiling below the memory
    model = tiny_model("qwen2")
    alone = default_token_budget(model, replica_config(config, 0.0, 1))
    shared = default_token_budget(model, replica_config(config, 0.0, 4))
    assert abs(shared * 4 - alone) < 0.05 * alone


def test_replicas_get_the_commands_local_paths_as_absolute_ones(tmp_path, monkeypatch):
    """A replica on a cluster that `ray start` began elsewhere runs in that cluster's working
    folder: `--model models/x` named nothing there and was looked up on the hub."""
    from rag_lookahead.serve.ray_deploy import local_paths_absolute

    (tmp_path / "models" / "x").mkdir(parents=True)
    (tmp_path / "idx").mkdir()
    (tmp_path / "default").mkdir()  # a folder named as the embedded model: the name still means that model
    monkeypatch.chdir(tmp_path)
    given = ServerConfig(model="models/x", index_dir="idx")
    sent = local_paths_absolute(given)
    assert sent.model == str(tmp_path / "models" / "x") and sent.index_dir == str(tmp_path / "idx")
    assert sent.model_name == "models/x"  # responses report the name given, as one process does
    named = ServerConfig(model="models/x", served_model_name="mine")
    assert local_paths_absolute(named).model_name == "mine"
    for kept in (ServerConfig(model="default"), ServerConfig(model="org/hub-model", index_dir="/elsewhere/idx")):
        assert local_paths_absolute(kept) is kept  # nothing here to point at: the cluster's own reading
    absolute = ServerConfig(model=str(tmp_path / "models" / "x"))
    assert local_paths_absolute(absolute) is absolute


def test_replicas_get_the_commands_environment_but_not_its_secrets():
    """Replicas on a `ray start` cluster have the cluster's environment: $RAG_LOOKAHEAD_HOME's
    default index loaded in one process and silently not in the replicas (/v1/rag answered 503)."""
    from rag_lookahead.serve.ray_deploy import replica_env

    environ = {
        "RAG_LOOKAHEAD_HOME": "/data/rl",
        "RAG_LOOKAHEAD_CACHE": "/cache/rl",
        "RAG_LOOKAHEAD_API_KEY": "sk-secret",  # the config carries the keys; Ray shows a runtime_env
        "HF_HOME": "/hf",
        "HF_HUB_OFFLINE": "1",
        "HF_TOKEN": "hf_secret",
        "XDG_DATA_HOME": "/xdg",
        "PATH": "/bin",
    }
    sent = replica_env(environ)
    assert sent == {
        k: environ[k]
        for k in ("RAG_LOOKAHEAD_HOME", "RAG_LOOKAHEAD_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "XDG_DATA_HOME")
    }
    config = ServerConfig()
    options = deployment_options(config, RaySettings(replicas=1), 0.0, sent)
    assert options["ray_actor_options"]["runtime_env"] == {"env_vars": sent}
    assert "runtime_env" not in deployment_options(config, RaySettings(replicas=1), 0.0, {})["ray_actor_options"]


def test_a_ray_address_where_nothing_listens_is_one_line_at_once():
    """``ray.init`` retried such an address for ~14 minutes and ignored Ctrl-C."""
    if ray is None:
        pytest.skip("Ray is not installed")
    from rag_lookahead.serve.ray_deploy import _check_reachable

    port = free_port()
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"RAY_ADDRESS=127.0.0.1:{port}: nothing answers there"):
        _check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 10
    for passed in ("", "auto", "local", "ray://127.0.0.1:1"):
        _check_reachable(passed)  # Ray looks these up itself and fails fast


@pytest.mark.parametrize(("raw", "kept"), [("   ", None), ("\t", None), (" local ", "local")])
def test_a_blank_or_padded_ray_address_is_read_by_ray_as_by_our_checks(monkeypatch, raw, kept):
    """Our checks read RAY_ADDRESS without its spaces (a blank one: a local Ray), while ``ray.init``
    read the raw value: "   " failed there with "Invalid address format". What Ray reads from the
    environment is now what the checks saw (no Ray is started: Ray's own address lookup is asked)."""
    if ray is None:
        pytest.skip("Ray is not installed")
    from ray._private import services

    from rag_lookahead.serve.ray_deploy import _starts_local_ray

    monkeypatch.setenv("RAY_ADDRESS", raw)
    assert _starts_local_ray()  # Ray's lookup raised on "   ", which read as joining a cluster
    assert os.environ.get("RAY_ADDRESS") == kept
    assert services.canonicalize_bootstrap_address(None) is None  # what ray.init() does with the environment


def test_a_ray_address_where_something_else_listens_is_one_line_at_once():
    """A web server (or the dashboard's 8265, or another ``serve``) at RAY_ADDRESS took the TCP
    connect, and ``ray.init`` then retried it as Ray's GCS for ~14.6 minutes, deaf to Ctrl-C. Ray's
    GCS speaks gRPC, so the address must answer HTTP/2's handshake (a real GCS passes it: see
    ``test_a_real_ray_gcs_passes_the_address_check``)."""
    import http.server
    import threading

    if ray is None:
        pytest.skip("Ray is not installed")
    from rag_lookahead.serve.ray_deploy import _check_reachable

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    try:
        for listener in (web.server_address[1], silent.getsockname()[1]):
            start = time.monotonic()
            with pytest.raises(ConfigError, match=f"RAY_ADDRESS=127.0.0.1:{listener} is not a Ray cluster: .* 6379"):
                _check_reachable(f"127.0.0.1:{listener}")
            assert time.monotonic() - start < 5
    finally:
        web.shutdown()
        web.server_close()
        silent.close()


def test_replicas_refuse_port_zero_before_starting_ray():
    """Ray's proxy takes a free port and never says which one (the measured bug: the log named port 0)."""
    code = (
        "import sys\n"
        "from rag_lookahead.serve import command\n"
        "code = command.main(['--replicas', '1', '--port', '0'])\n"
        "print(code, 'ray' in sys.modules and __import__('ray').is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if ray is None:
        assert "needs Ray Serve" in out.stderr
        return
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)
    assert "error: --port 0 (any free port) does not work with --replicas" in out.stderr


def serve_replicas_in_a_process(
    port: int, before: str = "", flags: Sequence[str] = (), timeout: float = 240
) -> tuple[list[str], str]:
    """``serve --replicas 1 --port PORT [FLAGS]`` in a fresh process (a local Ray of its own), after
    the code ``before``: (its exit code and whether Ray was still up at the end, its stderr)."""
    out = run_serve_replicas(port, before, flags, timeout)
    return out.stdout.split()[-2:], out.stderr


def run_serve_replicas(
    port: int, before: str = "", flags: Sequence[str] = (), timeout: float = 240, start_new_session: bool = False
) -> subprocess.CompletedProcess:
    """:func:`serve_replicas_in_a_process`'s process, as it ended (stdout ends with what main
    returned and whether Ray was still up, unless the process ended before main returned); with
    ``start_new_session``, in a session of its own (see :func:`session_processes`)."""
    code = (
        "import os, sys\n"
        "os.environ['RAY_USAGE_STATS_ENABLED'] = '0'\n"
        "from rag_lookahead.serve import command, ray_deploy\n"
        f"{before}"
        f"code = command.main(['--replicas', '1', '--port', '{port}', '--replica-cpus', '1', *{list(flags)!r}])\n"
        "print(code, __import__('ray').is_initialized())\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        start_new_session=start_new_session,
    )


@needs_ray
def test_replicas_refuse_a_port_another_server_holds():
    """Ray's proxy binds with SO_REUSEPORT: a second `serve --replicas` on the port of a first one
    (each starting its own local Ray) started, and the two servers split the traffic between them."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ended, stderr = serve_replicas_in_a_process(port)
    assert ended == ["1", "False"], stderr
    assert f"error: cannot listen on 127.0.0.1:{port}" in stderr


@needs_ray
def test_a_model_that_fails_its_warm_up_fails_the_start_in_one_line(tmp_path):
    """A remote-code forward whose ``**kwargs`` swallow the cache loads, then fails the engine's
    warm-up (a ConfigError at its first forward). A replica was up once its app was built, so the
    error reached Ray's health check: Ray replaced the replica, which loaded the model and failed
    again, forever (8 loads in 90 s), while `serve` said it was serving. Now the start fails as
    for a model that will not load: exit 1 and one line naming the cause."""
    folder = remote_folder(tmp_path, "LegacyKwargsForCausalLM")
    flags = ["--model", str(folder), "--trust-remote-code", "--dtype", "fp32", "--device", "cpu"]
    ended, stderr = serve_replicas_in_a_process(free_port(), flags=flags, timeout=200)
    assert ended == ["1", "False"], stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(
        "error: the Ray Serve replicas did not start: LegacyKwargsForCausalLM's forward takes past_key_values"
    ), errors


@needs_ray
def test_replicas_killed_as_they_start_end_the_start_in_one_line(tmp_path):
    """Ray's memory monitor killed each replica loading a model too big for memory, and Ray's Serve
    controller with it; each new controller started the replica again (Ray's constructor retries
    count exceptions, and start afresh with each controller), and serve.run waited with no limit:
    `serve --replicas` hung silently for good. Here the model's constructor kills its own process
    and the Serve controller (SIGKILL; no memory used). Now the start ends in one line naming the
    cause and exit 1, and nothing of the local Ray is left."""
    folder = remote_folder(tmp_path, "KilledOnLoadForCausalLM")
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={folder}", f"--port={free_port()}"]
    flags = ["--replicas=1", "--replica-cpus=1", "--trust-remote-code", "--dtype=fp32", "--device=cpu"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    log = tmp_path / "serve.log"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen([*command, *flags], stdout=out, stderr=out, env=env, start_new_session=True)
    try:
        code = server.wait(150)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        left = session_left(server.pid, 15)
    took = time.monotonic() - started
    stderr = log.read_text()
    assert code == 1, (code, stderr[-3000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.match(
        r"error: the Ray Serve replicas did not start: a replica's process was killed \d+ times as it started",
        errors[0],
    ), errors
    assert "Ray's Serve controller was killed" in errors[0], errors
    assert took < 120, took
    assert not left, [p.name() for p in left]


@needs_ray
def test_a_start_interrupted_while_the_replicas_load_exits_130():
    """It exited 0 after deleting the half-started app, which a supervisor reads as a clean run;
    the one-process server exits 130 there. (The interrupt is raised where serve.run waits.)"""
    interrupt = "def interrupted(*args, **kwargs):\n    raise KeyboardInterrupt\nray_deploy.deploy = interrupted\n"
    ended, stderr = serve_replicas_in_a_process(free_port(), before=interrupt)
    assert ended == ["130", "False"], stderr


@needs_ray
def test_a_sigterm_while_ray_starts_is_not_lost():
    """A SIGTERM that reached Ray's handler inside one of ray.init's fork hooks (where it landed
    about once in twelve tries of `systemctl stop` 2-3 s after the start) was dropped as "Exception
    ignored": the replicas then started and served until a second signal. Here it is sent from a
    fork hook of the driver on ray.init's third fork, and deploying would fail the test."""
    on_fork = (
        "import signal, threading\n"
        "forks = []\n"
        "def third_fork():\n"
        "    forks.append(1)\n"
        "    if len(forks) == 3 and threading.current_thread() is threading.main_thread():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.register_at_fork(after_in_parent=third_fork)\n"
        "def deployed(*args, **kwargs):\n"
        "    raise RuntimeError('deployed after a SIGTERM')\n"
        "ray_deploy.deploy = deployed\n"
    )
    ended, stderr = serve_replicas_in_a_process(free_port(), before=on_fork)
    assert ended == ["130", "False"], stderr
    assert "deployed after a SIGTERM" not in stderr


def session_processes(leader: int) -> list:
    """The processes still running in the session ``leader`` began (``start_new_session``), but
    itself (a zombie is no longer running: here PID 1 reaps the orphans only now and then)."""
    psutil = pytest.importorskip("psutil")
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if process.pid != leader and os.getsid(process.pid) == leader and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def session_left(leader: int, seconds: float) -> list:
    """:func:`session_processes` once none is left, or after ``seconds`` (those left are killed)."""
    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + seconds
    while (left := session_processes(leader)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return left


@needs_ray
@pytest.mark.parametrize("signals", [["SIGINT"], ["SIGTERM"], ["SIGINT", "SIGINT"]])
def test_a_signal_while_ray_starts_exits_130_and_leaves_no_ray_process(signals):
    """A signal during ray.init (2.5-5 s after the start: `systemctl stop`, Ctrl-C) was raised inside
    Ray's start-up: SIGTERM went to ray.init's own handler (SystemExit 15, no line of ours), SIGINT
    left Ray's half-started node unknown to ray.shutdown(), and either way Ray's agents were left
    running (ppid 1, for ~60 s). Now the signal is held until ray.init returns, the whole local Ray
    is stopped, and the command exits 130; a second signal ends ray.init at once, and the processes
    it had started are ended by their pids. Here the signals are sent once the raylet has started."""
    when_the_raylet_starts = (
        "import signal, threading, time, psutil\n"
        "print('pid', os.getpid(), file=sys.stderr, flush=True)\n"
        "def raylet_started():\n"
        "    for child in psutil.Process().children(recursive=True):\n"
        "        try:\n"
        "            if child.name() == 'raylet':\n"
        "                return True\n"
        "        except psutil.Error:\n"
        "            pass\n"
        "    return False\n"
        "def signal_when_the_raylet_starts():\n"
        "    while not raylet_started():\n"
        "        time.sleep(0.02)\n"
        f"    for name in {signals!r}:\n"
        "        os.kill(os.getpid(), getattr(signal, name))\n"
        "        time.sleep(0.3)\n"
        "threading.Thread(target=signal_when_the_raylet_starts, daemon=True).start()\n"
        "def deployed(*args, **kwargs):\n"
        "    raise RuntimeError('deployed after the signal')\n"
        "ray_deploy.deploy = deployed\n"
    )
    out = run_serve_replicas(free_port(), before=when_the_raylet_starts, timeout=120, start_new_session=True)
    left = session_left(int(re.search(r"^pid (\d+)$", out.stderr, re.M).group(1)), 15)
    assert out.returncode == 130, out.stderr[-3000:]
    assert "interrupted while the replicas started" in out.stderr, out.stderr[-3000:]
    assert "deployed after the signal" not in out.stderr, out.stderr[-3000:]
    assert not left, [p.name() for p in left]


def serve_replicas_popen(folder: Path, port: int, log: Path, flags: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m rag_lookahead.serve --replicas 1`` of the remote-code model ``folder`` on ``port``
    (a local Ray of its own), its output in ``log``; returned once it says it serves."""
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={folder}", f"--port={port}", "--replicas=1"]
    flags = ["--replica-cpus=1", "--trust-remote-code", "--dtype=fp32", "--device=cpu", "--log-level=info", *flags]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        server = subprocess.Popen([*command, *flags], stdout=out, stderr=out, env=env)
    deadline = time.monotonic() + 180
    while " on Ray Serve (" not in log.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            server.wait(30)
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.5)
    return server


@needs_ray
@pytest.mark.parametrize(("signals", "ends"), [(["SIGTERM", "SIGTERM"], -signal.SIGTERM), (["SIGINT", "SIGINT"], 130)])
def test_the_drain_and_the_exit_status_after_signals_are_one_processs(tmp_path, signals, ends):
    """As the one-process server (uvicorn) does: a second SIGTERM does not cut the drain short (a
    stream running finishes), a second Ctrl-C ends what still runs at once (an error event), and
    the command ends by the last signal: killed by SIGTERM (a shell's 143, a clean stop to
    systemd), exit 130 after SIGINT. `--replicas` exited 0 after either, and any second signal cut
    the drain short. The stream here lasts ~10 s (a model whose forwards take 50 ms each)."""
    folder = remote_folder(tmp_path, "SlowForCausalLM")
    log = tmp_path / "serve.log"
    port = free_port()
    server = serve_replicas_popen(folder, port, log, ["--no-lookahead", "--drain-seconds=60"])
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            chunks = r.iter_text()
            raw = next(chunks)  # the stream runs
            for name in signals:
                server.send_signal(getattr(signal, name))
                time.sleep(1.0)
            raw += "".join(chunks)
        code = server.wait(90)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
    stderr = log.read_text()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]", raw[-500:]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if signals[-1] == "SIGTERM":
        assert not errors and events[-2]["choices"][0]["finish_reason"] == "length", raw[-500:]
    else:
        assert errors and errors[0]["error"]["code"] == "shutting_down", raw[-500:]
    assert code == ends, stderr[-3000:]


@needs_ray
def test_a_sigterm_that_also_ended_rays_processes_exits_at_once():
    """A SIGTERM to the whole process group (systemd's stop, `timeout`) also ends the local Ray's
    GCS: the drain then waited 60 s on it and Ray's client aborted the process with exit 1. Here
    the GCS is stopped and the driver signalled once the app is up (a stand-in deploy, no model).
    It ends by the SIGTERM, as the one-process server does."""
    group_signal = (
        "import signal, threading, time, psutil\n"
        "def stop_the_group():\n"
        "    for child in psutil.Process().children(recursive=True):\n"
        "        if child.name().startswith('gcs_server'):\n"
        "            child.kill()\n"
        "    time.sleep(1)\n"
        "    print('signalled at', time.time(), file=sys.stderr, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "def deployed(*args, **kwargs):\n"
        "    threading.Timer(1.0, stop_the_group).start()\n"
        "    return 'http://127.0.0.1:1'\n"
        "ray_deploy.deploy = deployed\n"
    )
    out = run_serve_replicas(free_port(), before=group_signal)
    took = time.time() - float(re.search(r"^signalled at (\S+)$", out.stderr, re.M).group(1))
    assert out.returncode == -signal.SIGTERM, out.stderr[-3000:]
    assert "Ray's own processes are gone" in out.stderr and "Failed to connect to GCS" not in out.stderr
    assert took < 45, (took, out.stderr[-3000:])


@needs_ray
def test_a_sigterm_to_the_whole_process_group_ends_the_command_at_once(config, tmp_path):
    """systemd's default stop (KillMode=control-group), `timeout` and `kill -- -PGID` send SIGTERM to
    the whole group, Ray's GCS included, which still takes connections while it shuts down: the
    drain's first write to it then waited 60 s until Ray's client aborted the process (exit 1), or
    failed with Ray's "RPC error: CANCELLED" traceback. Now `serve` says there is nothing to drain
    and ends by the SIGTERM at once (as one process does), and nothing of the local Ray it started
    is left."""
    port = free_port()
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={config.model}", f"--port={port}"]
    flags = ["--replicas=1", "--replica-cpus=1", "--dtype=fp32", "--device=cpu", "--drain-seconds=30"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:  # in a session of its own, as systemd starts a service
        server = subprocess.Popen(
            [*command, *flags, "--log-level=info"], stdout=out, stderr=out, env=env, start_new_session=True
        )

    try:
        deadline = time.monotonic() + 180
        while " on Ray Serve (" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        started = time.monotonic()
        os.killpg(server.pid, signal.SIGTERM)
        code = server.wait(90)
        took = time.monotonic() - started
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        left = session_left(server.pid, 10)
    stderr = log.read_text()
    print(f"\nserve ended {took:.1f} s after the group's SIGTERM")
    assert code == -signal.SIGTERM, stderr[-3000:]
    assert "nothing to drain" in stderr and "Failed to connect to GCS" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert took < 20, (took, stderr[-3000:])  # not Ray's 60 s
    assert not left, [p.name() for p in left]


@needs_ray
@pytest.mark.parametrize("fault", ["raylet_killed", "controller_frozen"])
def test_serve_ends_when_rays_processes_die_or_hang(config, tmp_path, fault):
    """raylet_killed: when this node's raylet died (kill -9, the OOM killer) `serve --replicas`
    went on running while its port refused every connection, and once Ray had marked the node dead
    a SIGTERM, a second one and SIGINT did nothing (the drain waited for good on serve.status();
    only SIGKILL ended it). Now it exits 1 within seconds with one line saying so.
    controller_frozen: a Serve controller that does not answer (SIGSTOP here: a frozen process)
    blocked the drain the same way; now a Ctrl-C after the SIGTERM ends it at once (exit 130)."""
    psutil = pytest.importorskip("psutil")
    port = free_port()
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={config.model}", f"--port={port}"]
    flags = ["--replicas=1", "--replica-cpus=1", "--dtype=fp32", "--device=cpu", "--drain-seconds=29.5"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:  # info: the line that says it serves (Ray's /health answers before that)
        server = subprocess.Popen([*command, *flags, "--log-level=info"], stdout=out, stderr=out, env=env)
    ray_processes = []
    try:
        deadline = time.monotonic() + 180
        while " on Ray Serve (" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        ray_processes = psutil.Process(server.pid).children(recursive=True)
        (raylet,) = [p for p in ray_processes if p.name() == "raylet"]
        (controller,) = [p for p in ray_processes if p.name().startswith("ray::ServeController")]  # + its task
        started = time.monotonic()
        if fault == "raylet_killed":
            raylet.kill()
        else:
            controller.suspend()
            server.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # the drain is asking the controller
            server.send_signal(signal.SIGINT)
        code = server.wait(60)
        took = time.monotonic() - started
        _, left = psutil.wait_procs(ray_processes, timeout=10)  # the local Ray this `serve` started goes with it
    finally:
        for process in [*ray_processes, psutil.Process(server.pid)] if server.poll() is None else ray_processes:
            with contextlib.suppress(psutil.Error):  # Ray's own, and the old code's server (deaf to SIGTERM)
                process.kill()
        server.wait(30)
    stderr = log.read_text()
    print(f"\n{fault}: serve ended {took:.1f} s after the fault")
    if fault == "raylet_killed":
        assert code == 1, stderr[-3000:]
        assert re.search(r"^error: Ray's raylet on this node \(\S+\) died", stderr, re.M), stderr[-3000:]
        assert took < 30, (took, stderr[-3000:])
    else:
        assert code == 130 and "which replicas still run (its controller or node is gone?)" in stderr, stderr[-3000:]
        assert "draining the replicas for up to 29.5 s" in stderr, stderr[-3000:]  # as given, not rounded to 30
        assert not left, [p.name() for p in left]
        assert took < 15, (took, stderr[-3000:])  # not the drain's 29.5 s + 10 s


@needs_ray
def test_a_drain_ray_did_not_answer_ends_without_a_crash():
    """The drain's question to a frozen Serve controller was left waiting inside Ray's core worker,
    and ``ray.shutdown()`` tore the core worker down under it: the command then died after its last
    line whenever the waiting thread woke at the wrong moment (it checks for signals every second),
    by SIGSEGV (-11, once in a full CI run of the controller_frozen case above) or with Ray's "The
    core worker has already been shutdown" (exit 1). Here the question waits on a frozen actor of
    the driver's own (a stand-in deploy, no model), and ``ray.shutdown()`` says whether a question
    still waits when it runs (it did every time). Now the command exits at once instead (130: a
    SIGTERM, then a Ctrl-C that ends the drain), and the local Ray it started is stopped all the same
    (the frozen actor with it)."""
    psutil = pytest.importorskip("psutil")
    frozen_ray = (
        "import signal, threading, time, ray\n"
        "def deployed(*args, **kwargs):\n"
        "    @ray.remote(num_cpus=0)\n"
        "    class Frozen:\n"
        "        def pid(self):\n"
        "            return os.getpid()\n"
        "    frozen = Frozen.remote()\n"
        "    pid = ray.get(frozen.pid.remote())\n"
        "    print('frozen', pid, file=sys.stderr, flush=True)\n"
        "    os.kill(pid, signal.SIGSTOP)\n"
        "    ray_deploy._running_replicas = lambda serve: ray.get(frozen.pid.remote())\n"
        "    def two_signals():\n"
        "        for sig in (signal.SIGTERM, signal.SIGINT):\n"
        "            time.sleep(1.0)\n"
        "            os.kill(os.getpid(), sig)\n"
        "    threading.Thread(target=two_signals, daemon=True).start()\n"
        "    return 'http://127.0.0.1:1'\n"
        "ray_deploy.deploy = deployed\n"
        "shutdown = ray.shutdown\n"
        "def checked_shutdown(*args, **kwargs):\n"
        "    if any(t.name == 'ray-call' and t.is_alive() for t in threading.enumerate()):\n"
        "        print('ray.shutdown() while a question still waits in Ray', file=sys.stderr, flush=True)\n"
        "    shutdown(*args, **kwargs)\n"
        "ray.shutdown = checked_shutdown\n"
    )
    out = run_serve_replicas(free_port(), before=frozen_ray, timeout=120)
    pid = int(re.search(r"^frozen (\d+)$", out.stderr, re.M).group(1))
    try:
        assert "which replicas still run (its controller or node is gone?)" in out.stderr, out.stderr[-3000:]
        assert "ray.shutdown() while a question still waits in Ray" not in out.stderr, out.stderr[-3000:]
        assert out.returncode == 130, out.stderr[-3000:]
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(10)  # TimeoutExpired: the local Ray's actor outlived the command
    finally:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def test_the_default_install_does_not_import_ray(monkeypatch):
    """``serve`` imports no Ray; ``--replicas`` without Ray is one line naming the extra (exit 1);
    ``--max-replicas`` alone is a bad setting (exit 2 under ``python -m rag_lookahead.serve``)."""
    code = (
        "import sys\n"
        "from rag_lookahead.serve import command, ray_deploy\n"
        "ray_deploy.settings_from_args({'replicas': 2})\n"
        "print('ray' in sys.modules)\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "print(command.main(['--replicas', '2']), command.main(['--max-replicas', '3']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "1", "2"], (out.stdout, out.stderr)
    assert "error: --replicas needs Ray Serve, which is not installed: pip install 'rag-lookahead[ray]'" in out.stderr
    assert "error: --max-replicas needs --replicas" in out.stderr
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'rag-lookahead\[ray\]'"):
        import_ray()


@needs_ray
def test_routing_key_is_the_session_else_the_api_key():
    import pickle
    from types import SimpleNamespace

    from ray.serve._private.common import StreamingHTTPRequest

    from rag_lookahead.serve.ray_router import key_from_headers, routing_key

    def pending(session: str, headers: list, http: bool = True) -> SimpleNamespace:
        request = StreamingHTTPRequest({"type": "http", "headers": headers}, proxy_actor_name="proxy")
        metadata = SimpleNamespace(session_id=session, is_http_request=http)
        return SimpleNamespace(metadata=metadata, args=[pickle.dumps(request)])

    bearer = [(b"authorization", b"Bearer secret-key-1")]
    key = key_from_headers(bearer)
    assert key.startswith("key:") and "secret" not in key
    assert key_from_headers([(b"Authorization", b"bearer   secret-key-1")]) == key
    assert key_from_headers([(b"authorization", b"Basic eHl6")]) is None and key_from_headers([]) is None
    assert routing_key(pending("s1", bearer)) == "session:s1"
    assert routing_key(pending("", bearer)) == key
    assert routing_key(pending("", [])) is None
    assert routing_key(pending("", bearer, http=False)) is None  # a handle's bytes are never unpickled


@contextlib.contextmanager
def ray_start_cluster(cwd: Path, env: dict[str, str]):
    """A one-node Ray cluster as `ray start --head` makes one, begun in ``cwd`` with ``env``: its
    address. Its own temp folder keeps other Rays on this machine from joining it (a plain
    ``ray.init`` joins the cluster named in the default folder's ``ray_current_cluster``). With
    ``--block``, a SIGTERM stops the processes it started; any left are killed by their ids."""
    import psutil

    temp = tempfile.mkdtemp(prefix="ray_", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    log = cwd / "ray_start.log"
    ray_cli = Path(sys.executable).with_name("ray")
    command = [
        str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
        f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={temp}", "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "wb") as out:
        head = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    started: list = []
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.5)
        started = psutil.Process(head.pid).children(recursive=True)
        yield f"127.0.0.1:{port}"
    finally:
        started += psutil.Process(head.pid).children(recursive=True) if head.poll() is None else []
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(temp, ignore_errors=True)


@needs_ray
def test_replicas_on_a_ray_start_cluster_read_the_commands_paths_and_environment(config, tmp_path):
    """`serve --replicas` joining a cluster that `ray start` began in another folder: a relative
    `--model` named nothing in the replicas ("neither a local folder nor in the Hugging Face
    cache"), and the command's environment never reached them ($RAG_LOOKAHEAD_HOME's index loaded in
    one process, not in the replicas). Here the environment is $RAG_LOOKAHEAD_CACHE, where a
    replica keeps the cost curve it measures (an index would load the embedder in the replica)."""
    folder = Path(config.model)
    cluster_dir, cache = tmp_path / "cluster", tmp_path / "cache"
    cluster_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAG_LOOKAHEAD_CACHE")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # `ray start` asks for a token otherwise
    port = free_port()
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    command = [sys.executable, "-m", "rag_lookahead.serve", "--replicas=1", f"--port={port}", f"--model={folder.name}"]
    with ray_start_cluster(cluster_dir, env) as address:
        driver_env = {**env, "RAY_ADDRESS": address, "RAG_LOOKAHEAD_CACHE": str(cache)}
        with open(tmp_path / "serve.log", "wb") as out:
            server = subprocess.Popen([*command, *flags], cwd=folder.parent, env=driver_env, stdout=out, stderr=out)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 240
            while not ok(base + "/health"):
                running = server.poll() is None and time.monotonic() < deadline
                assert running, (tmp_path / "serve.log").read_text(errors="replace")[-3000:]
                time.sleep(0.5)
            health = httpx.get(base + "/health", timeout=10).json()
            assert health["model"] == folder.name  # the name given, as one process reports it
            body = {"prompt": PROMPTS[0], "max_tokens": 4}
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
            assert (cache / "cost_curves.json").is_file(), "the replica did not get $RAG_LOOKAHEAD_CACHE"
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


@needs_ray
def test_a_cluster_with_token_authentication_is_named_as_the_cause(config, tmp_path):
    """Ray 2.60's `ray start` turns on token authentication, and a driver that sends no token
    (RAY_AUTH_MODE unset) was refused with "Failed to connect to Ray cluster at ...", which names no
    cause; the cause was only in Ray's C++ warnings above it. Now the one line names it and the
    setting that fixes it. (The cluster's token is given in its environment, not ~/.ray.)"""
    import secrets

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    command = [sys.executable, "-m", "rag_lookahead.serve", "--replicas=1", f"--port={free_port()}"]
    home = tmp_path / "home"  # a home without ~/.ray/auth_token (a service's, say)
    home.mkdir()
    with ray_start_cluster(tmp_path, cluster_env) as address:
        out, tokenless = (
            subprocess.run(
                [*command, f"--model={config.model}", "--device=cpu"],
                env={**env, "RAY_ADDRESS": address, **more},
                capture_output=True,
                text=True,
                timeout=180,
            )
            for more in ({}, {"RAY_AUTH_MODE": "token", "HOME": str(home)})
        )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(
        f"error: could not reach the Ray cluster at RAY_ADDRESS={address}: the cluster uses Ray's token authentication"
    ), errors
    assert "set RAY_AUTH_MODE=token" in errors[0], errors
    # the mode set but no token anywhere: Ray refuses before it reaches the cluster, which refused nothing
    errors = [line for line in tokenless.stderr.splitlines() if line.startswith("error:")]
    assert tokenless.returncode == 1 and len(errors) == 1, tokenless.stderr[-3000:]
    assert "RAY_AUTH_MODE=token is set but no Ray token was found" in errors[0], errors


@needs_ray
def test_the_start_watch_counts_controller_restarts_beside_a_dead_earlier_controller():
    """`serve shutdown` (which our own error lines advise) leaves the earlier Serve controller listed
    DEAD in Ray's actor table, after the live one: its restart count (0) was read last and stood
    for the live controller's, so a controller killed again and again as the replicas started was
    never counted, and such a start could wait for good."""
    code = (
        "import os, signal, time, ray\n"
        "from ray import serve\n"
        "from ray._private import state\n"
        "from rag_lookahead.serve.ray_deploy import StartWatch\n"
        "ray.init(num_cpus=1, include_dashboard=False)\n"
        f"serve.start(http_options={{'port': {free_port()}}})\n"
        "serve.shutdown()\n"
        f"serve.start(http_options={{'port': {free_port()}}})\n"
        "def controllers(): return [a for a in state.actors().values() if a['Name'] == 'SERVE_CONTROLLER_ACTOR']\n"
        "watch = StartWatch(limit=1)\n"
        "for kill in range(2):\n"
        "    pid = next(a['Pid'] for a in controllers() if a['State'] == 'ALIVE')\n"
        "    os.kill(pid, signal.SIGKILL)\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not any(a['State'] == 'ALIVE' and a['NumRestarts'] == kill + 1 for a in controllers()):\n"
        "        assert time.monotonic() < deadline, controllers()\n"
        "        time.sleep(0.5)\n"
        "print('watch:', len(controllers()), watch.hopeless(), watch.seen())\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("watch:")]  # Ray logs to stdout too
    assert said and said[0].startswith("watch: 2 True Ray's Serve controller was killed 2 times"), out.stdout


class ControllerTable:
    """Ray's actor table as :class:`StartWatch` reads it (``ray._private.state.actors()``), holding
    only Serve controllers: id -> restarts so far. A controller killed before this start cannot be
    staged without Ray (the real table is read in the test above)."""

    def __init__(self, restarts: dict[str, int]) -> None:
        self.restarts = restarts

    def actors(self) -> dict[str, dict]:
        return {
            actor_id: {"Name": "SERVE_CONTROLLER_ACTOR", "State": "ALIVE", "NumRestarts": count}
            for actor_id, count in self.restarts.items()
        }


@needs_ray
def test_the_start_watch_does_not_count_a_controllers_restarts_before_the_start(monkeypatch):
    """A controller restarted 3 times before this start (an earlier app's) read as killed 3 times
    as these replicas started: a start that nothing hindered was called hopeless."""
    import ray._private

    from rag_lookahead.serve.ray_deploy import StartWatch

    table = ControllerTable({"controller": 3})
    monkeypatch.setattr(ray._private, "state", table)
    watch = StartWatch(limit=1)
    assert watch.seen() == "" and not watch.hopeless()
    table.restarts["controller"] = 5
    assert watch.seen() == "Ray's Serve controller was killed 2 times as the replicas started (out of memory?)"
    assert watch.hopeless()


# ---------------------------------------------------------------- fixtures


#: The settings of both servers, as ``serve`` options and as ServerConfig fields (with LOOKAHEAD).
SETTINGS = dict(
    dtype="fp32",
    device="cpu",
    max_batch_size=8,
    max_queue=256,
    max_tokens_limit=64,
    default_max_tokens=16,
    drain_seconds=2.0,
    log_level="warning",
)
LOOKAHEAD_FLAGS = ["--budget", "fixed", "--decoding-length", "16"]


@pytest.fixture(scope="module")
def config(tmp_path_factory, tokenizer) -> ServerConfig:
    """Every replica's config: the tiny Qwen2 saved to a folder, fp32 on the CPU."""
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model("qwen2").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ServerConfig(model=str(folder), port=free_port(), lookahead_config=LOOKAHEAD, **SETTINGS)


@pytest.fixture(scope="module")
def one_process(config) -> dict:
    """``python -m rag_lookahead.serve`` with the same settings in its own process, before Ray starts
    (so neither it nor the load's client shares a process or the cores with the other): its text for
    each prompt and its time for the 200-request / 32-client load."""
    port = free_port()
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    command = [sys.executable, "-m", "rag_lookahead.serve", f"--model={config.model}", f"--port={port}"]
    server = subprocess.Popen([*command, *flags, *LOOKAHEAD_FLAGS])
    base = f"http://127.0.0.1:{port}"

    async def measure() -> dict:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            texts = {i: (await complete(client, i))["text"] for i in range(len(PROMPTS))}
        await load(base, 32, 32)  # warm-up
        results, seconds = await load(base, 200, 32)
        check_load(results, texts)
        return {"texts": texts, "seconds": seconds, "tokens_per_second": tokens_per_second(results, seconds)}

    try:
        deadline = time.monotonic() + 120
        while not ok(base + "/health"):
            assert server.poll() is None and time.monotonic() < deadline, "the single-process server did not start"
            time.sleep(0.2)
        return asyncio.run(measure())
    finally:
        server.terminate()
        server.wait(60)


def ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def endpoint(config, one_process):
    """Two CPU replicas on a local Ray; the proxy's base URL."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    start = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    try:
        base = deploy(config, RaySettings(replicas=2, num_cpus=1))
        print(f"\nRay and 2 replicas up in {time.monotonic() - start:.0f} s")
        yield base
    finally:
        with contextlib.suppress(Exception):
            undeploy()
        serve.shutdown()
        ray.shutdown()


# ---------------------------------------------------------------- tests


@needs_ray
def test_both_replicas_answer_as_one_process(endpoint, one_process):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=endpoint, timeout=60) as client:
            return [
                await complete(client, k % len(PROMPTS), ("plain", "stream")[k % 2], {"X-Session-Id": f"s{k}"})
                for k in range(16)
            ]

    results = asyncio.run(run())
    for r in results:
        assert r["status"] == 200 and r["text"] == one_process["texts"][r["i"]], r
    assert len({r["replica"] for r in results}) == 2, "16 sessions all went to one replica"


@needs_ray
def test_a_second_deploy_on_the_cluster_is_refused_and_the_first_keeps_serving(endpoint, config):
    """Serve keeps one app per name and one proxy address per cluster: a second ``serve --replicas``
    used to replace the running app and serve on the old address while logging its own (measured:
    asked for another port, answered on the first). It is refused now, and the first app keeps
    answering."""
    import dataclasses

    with pytest.raises(ConfigError, match="already runs a Serve app named 'rag_lookahead'"):
        deploy(dataclasses.replace(config, port=free_port()), RaySettings(replicas=1, num_cpus=1))
    assert serve.status().applications[APP_NAME].status == "RUNNING"
    r = httpx.post(endpoint + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@needs_ray
def test_a_second_start_racing_the_first_is_refused_by_its_claim(endpoint, config, monkeypatch):
    """Two starts at the same moment both found no app and both went on: one served nothing while
    logging an address, and stopping either deleted the other's app. The first to claim the app's
    name on the cluster wins; the other is refused before it starts anything."""
    from rag_lookahead.serve import ray_deploy

    monkeypatch.setattr(ray_deploy, "APP_NAME", "rag_lookahead_race")  # no such app yet: the check passes
    first = ray_deploy._claim_app(ray)  # the other command, past the check and claiming
    try:
        with pytest.raises(ConfigError, match="another `rag_lookahead serve --replicas` is starting or serving"):
            deploy(config, RaySettings(replicas=1, num_cpus=1))
        assert "rag_lookahead_race" not in serve.status().applications
    finally:
        ray.kill(first)


@needs_ray
@pytest.mark.parametrize("second_interrupt", [False, True])
def test_an_interrupted_start_deletes_its_app_or_says_it_may_be_left(endpoint, config, monkeypatch, second_interrupt):
    """^C while the replicas start deletes the half-started app; a second ^C during that delete
    used to end in the same "deleted them" line although the delete was cut short, and on a
    cluster that outlives the command the app was left (the next start refused). It is its own
    exception now, which ``run_on_ray`` reports as possibly left. Our app keeps serving throughout."""
    from rag_lookahead.serve import ray_deploy

    monkeypatch.setattr(ray_deploy, "APP_NAME", "rag_lookahead_interrupted")  # beside the running app
    deleted = []

    def interrupted_run(*args, **kwargs):
        raise KeyboardInterrupt  # the first ^C, while serve.run waits for the replicas

    def delete(name, *args, **kwargs):
        deleted.append(name)
        if second_interrupt:
            raise KeyboardInterrupt

    monkeypatch.setattr(ray.serve.api, "_run", interrupted_run)
    monkeypatch.setattr(serve, "delete", delete)
    with pytest.raises(KeyboardInterrupt) as raised:
        deploy(config, RaySettings(replicas=1, num_cpus=1))
    assert deleted == ["rag_lookahead_interrupted"]
    assert isinstance(raised.value, ray_deploy.StartAbandoned) == second_interrupt
    monkeypatch.undo()
    r = httpx.post(endpoint + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@needs_ray
def test_a_real_ray_gcs_passes_the_address_check(endpoint):
    """The gRPC handshake the RAY_ADDRESS check asks for is one Ray's GCS answers."""
    from rag_lookahead.serve.ray_deploy import _check_reachable

    _check_reachable(ray.get_runtime_context().gcs_address)


@needs_ray
def test_session_and_api_key_stick_to_one_replica(endpoint):
    async def replicas_of(headers: dict, count: int) -> set[str]:
        async with httpx.AsyncClient(base_url=endpoint, timeout=60) as client:
            results = await asyncio.gather(*(complete(client, n % 3, headers=headers) for n in range(count)))
        assert all(r["status"] == 200 for r in results)
        return {r["replica"] for r in results}

    for session in ("alpha", "beta", "gamma"):
        assert len(asyncio.run(replicas_of({"X-Session-Id": session}, 6))) == 1, session
    for key in ("key-one-1234", "key-two-5678"):  # no session header: the API key is the session
        assert len(asyncio.run(replicas_of({"Authorization": f"Bearer {key}"}, 6))) == 1, key
    keys = {next(iter(asyncio.run(replicas_of({"Authorization": f"Bearer key-{k:04d}"}, 1)))) for k in range(16)}
    assert len(keys) == 2, "16 API keys all went to one replica"


@needs_ray
def test_a_full_replica_passes_its_session_on(endpoint, one_process):
    """Past ``max_ongoing_requests`` (16 here) one session's requests go to the next replica."""

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=48)
        async with httpx.AsyncClient(base_url=endpoint, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(complete(client, 4, headers={"X-Session-Id": "busy"}) for _ in range(48)))

    results = asyncio.run(run())
    assert all(r["status"] == 200 and r["text"] == one_process["texts"][4] for r in results)
    assert len({r["replica"] for r in results}) == 2


@needs_ray
def test_load_200_requests_32_clients_on_two_replicas(endpoint, one_process):
    sessions = probe_replicas(endpoint)
    assert len(sessions) == 2
    asyncio.run(load(endpoint, 32, 32))  # warm-up
    before = replica_metrics(endpoint, sessions)
    results, seconds = asyncio.run(load(endpoint, 200, 32))
    time.sleep(1.0)  # a dropped stream's cancellation reaches its replica's engine
    after = replica_metrics(endpoint, sessions)
    check_load(results, one_process["texts"])
    served = {r: sum(x["replica"] == r for x in results) for r in sessions}
    assert all(served.values()) and sum(served.values()) == 200, served
    done = sum(metric(after[r], COMPLETED) - metric(before[r], COMPLETED) for r in sessions)
    dropped = sum(metric(after[r], CANCELLED) - metric(before[r], CANCELLED) for r in sessions)
    assert done + dropped == 200 and done >= 160, (done, dropped)
    rate = tokens_per_second(results, seconds)
    print(
        f"\n200 requests / 32 clients, tiny model, this machine ({os.cpu_count()} cores): "
        f"1 process {one_process['seconds']:.1f} s ({one_process['tokens_per_second']:.0f} tokens/s), "
        f"2 Ray replicas {seconds:.1f} s ({rate:.0f} tokens/s; per replica {served})"
    )


@needs_ray
def test_a_killed_replica_fails_its_requests_and_is_replaced(endpoint, one_process):
    """Killing a replica mid-load: each of its requests finishes, or fails with an error (5xx, a
    stream cut short, a closed connection) within seconds; none hangs. The session then moves to
    a live replica and Ray starts a replacement."""
    victim, session = next(iter(probe_replicas(endpoint).items()))
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + victim))
    actor = ray.get_actor(name, namespace="serve")
    headers = {"X-Session-Id": session}

    async def run() -> list:
        async with httpx.AsyncClient(base_url=endpoint, timeout=60, limits=httpx.Limits(max_connections=24)) as client:
            tasks = [asyncio.ensure_future(complete(client, 4, ("plain", "stream")[n % 2], headers)) for n in range(24)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=30)
            ray.kill(actor, no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)

    start = time.monotonic()
    outcomes = asyncio.run(run())
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, httpx.TransportError), repr(outcome)  # the connection closed: an error
        elif outcome["status"] == 200:
            assert outcome["text"] == one_process["texts"][4]
        else:
            assert outcome["status"] == "truncated" or outcome["status"] >= 500, outcome
    failed = sum(isinstance(o, BaseException) or o["status"] != 200 for o in outcomes)
    print(f"\nkilled replica: {len(outcomes) - failed} of {len(outcomes)} requests finished, {failed} failed clearly")

    deadline = time.monotonic() + 60
    while True:  # the session's next request is answered by a live replica
        r = httpx.post(
            endpoint + "/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": BUDGETS[4]}, headers=headers
        )
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert r.json()["choices"][0]["text"] == one_process["texts"][4] and r.headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 180
    while _running_replicas(serve) < 2:
        assert time.monotonic() < deadline, "Ray did not replace the killed replica"
        time.sleep(1.0)
    while len(replicas := probe_replicas(endpoint)) < 2:  # until the proxy's router hears of it
        assert time.monotonic() < deadline, "the replacement replica was never routed to"
        time.sleep(1.0)
    assert victim not in replicas
    print(f"replacement running after {time.monotonic() - start:.0f} s")


@needs_ray
def test_a_client_that_leaves_is_counted_499_not_500(endpoint):
    """Ray cancels a replica's handler when its client hangs up (no ``http.disconnect`` reaches the
    app), and the response counter took that for a 500: a 5xx alert fired on ordinary clients."""
    (replica, session), *_ = probe_replicas(endpoint, want=1).items()
    body = {"prompt": ([5, 9, 17, 3, 60, 61, 2] * 26)[:180], "max_tokens": 64}
    label = '{endpoint="/v1/completions",status="%s"}'

    def counted(status: int) -> float:
        return metric(
            replica_metrics(endpoint, {replica: session})[replica], "rag_lookahead_requests_total", label % status
        )

    async def abandon(count: int = 16) -> None:
        async with httpx.AsyncClient(base_url=endpoint, timeout=60) as client:
            sent = [
                asyncio.ensure_future(client.post("/v1/completions", json=body, headers={"X-Session-Id": session}))
                for _ in range(count)
            ]
            await asyncio.sleep(0.15)  # decoding: 64 tokens of each take longer
            for request in sent:
                request.cancel()
            await asyncio.gather(*sent, return_exceptions=True)

    before = {status: counted(status) for status in (499, 500)}
    asyncio.run(abandon())
    deadline = time.monotonic() + 30
    while counted(499) == before[499]:
        assert time.monotonic() < deadline, "no request was counted as left by its client"
        time.sleep(0.5)
    time.sleep(1.0)  # the rest settle
    assert counted(500) == before[500]


# ---------------------------------------------------------------- last: it stops the deployment


@needs_ray
def test_the_drain_answers_503_lets_running_requests_finish_then_stops(endpoint, one_process):
    """The drain deleted the app first, which removed its route: every request during it got Ray's
    plain-text 404 (clients do not retry a 404), and requests still running at its end were cut off
    with no error. Now each replica's engine drains as one process does, and the app is deleted once
    they are idle."""
    from ray.experimental.internal_kv import _internal_kv_list, _internal_kv_put

    from rag_lookahead.serve.ray_deploy import DRAIN_KEY, DRAINED_PREFIX, KV_NAMESPACE, drain

    async def loaded_then_told() -> list[dict]:
        loaded = asyncio.ensure_future(load(endpoint, 96, 24))
        await asyncio.sleep(0.5)  # the load is running on both replicas
        _internal_kv_put(DRAIN_KEY, b"30", namespace=KV_NAMESPACE)  # drain()'s first step, the app kept
        return (await loaded)[0]

    results = asyncio.run(loaded_then_told())
    assert {r["status"] for r in results} <= {200, 503}, [r for r in results if r["status"] not in (200, 503)][:3]
    for r in results:  # admitted before the drain: finished, as alone (503: came after it began)
        if r["status"] == 200 and r["kind"] != "drop":
            assert r["text"] == one_process["texts"][r["i"]], r
    deadline = time.monotonic() + 30
    while len(_internal_kv_list(DRAINED_PREFIX, namespace=KV_NAMESPACE)) < 2:  # both replicas idle
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with httpx.Client(base_url=endpoint, timeout=30) as client:  # draining, still deployed: one process's answers
        for k in range(6):
            r = client.post(
                "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}, headers={"X-Session-Id": f"d{k}"}
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
    start = time.monotonic()
    drain(30.0)
    assert time.monotonic() - start < 10  # deleted once idle, not after the whole 30 s
    assert APP_NAME not in serve.status().applications
