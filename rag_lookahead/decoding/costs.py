"""How many draft nodes to verify: chosen from what a forward of n tokens costs.

On a GPU at batch 1 a forward of 64 tokens costs about what one token costs, so a large tree
is free. On a CPU it is not (0.5B bf16 here: ~95 ms for 1 token, ~120 ms for 16, ~200 ms for 64), so each
extra node must pay for itself. The cost curve is measured once per model (a few forwards
over a dummy cache) and the drafter's acceptance estimates, corrected by how well they
predicted so far, give the expected gain; the size with the best gain per second wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rag_lookahead.atomic import remove_leftovers, temporary_names, write_json_atomic
from rag_lookahead.cpu_linear import mkl_packed_works, onednn_linear_works, packed_kernel
from rag_lookahead.decoding.attention_backends import without_cudnn_attention
from rag_lookahead.decoding.draft import DraftTree
from rag_lookahead.decoding.inputs import context_limit, vocab_size
from rag_lookahead.decoding.profile import profile_of
from rag_lookahead.decoding.windows import full_cache
from rag_lookahead.errors import ConfigError
from rag_lookahead.greedy_head import capture_hidden, greedy_head_of
from rag_lookahead.int8_linear import packing_engine
from rag_lookahead.locks import exclusive
from rag_lookahead.paths import cache_dir

log = logging.getLogger(__name__)


#: curves the cache file keeps (one per model, dtype, machine and layout): a cache must not grow
#: without bound, and every model folder measured once (a test's temporary copy too) adds a key
MAX_STORED_CURVES = 32
CURVE_LOCK_TIMEOUT_S = 30.0  # another process writing the file takes milliseconds; past this, skip keeping ours


@dataclass
class CostCurve:
    """Seconds of one forward that appends ``n`` tokens (all rows together), interpolated."""

    sizes: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                t = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
                return secs[i - 1] + t * (secs[i] - secs[i - 1])
        slope = (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2])
        return secs[-1] + max(slope, 0.0) * (n - sizes[-1])


def lower_hull(curve: CostCurve) -> CostCurve:
    """The curve through the lower convex hull of its points. A forward's cost per extra token
    does not fall as the forward grows (flat, then linear on a GPU; memory-bound, then
    compute-bound on a CPU), so a point above the chord of its neighbours was timed slow, by
    something else running. Such a point skews every budget decision near it: a curve measured
    here with 32 tokens at 289 ms between 154 (16) and 383 (64) made 58-token steps of 32 rows
    look 1.28x a 32-token one, where they cost 1.70x, and the budget drafted steps that lost."""
    hull: list[tuple[int, float]] = []
    for point in zip(curve.sizes, curve.seconds):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if y2 < y1 + (point[1] - y1) * (x2 - x1) / (point[0] - x1):
                break
            hull.pop()  # on or above the chord from its left neighbour to this point
        hull.append(point)
    on_hull = CostCurve([x for x, _ in hull], [y for _, y in hull])
    return CostCurve(list(curve.sizes), [on_hull(n) for n in curve.sizes])


def _curve_key(model) -> str | None:
    """What the cost depends on: the model, dtype, hardware (by name), attention kernel and
    device map, threads, torch version and the linear layers' layout (``cpu_linear``); a shared
    cache file never hands one GPU's curve to another."""
    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return None  # an in-memory model (tests): nothing stable to key a file on
    params = sum(p.numel() for p in model.parameters())
    devices = model_devices(model)
    hardware = ",".join(f"{d}={device_name(d)}" for d in devices)
    attention = getattr(model.config, "_attn_implementation", None)
    if any(d.type == "cuda" for d in devices):
        attention = f"{attention} without cudnn"  # curves timed before attention_backends ran on cuDNN's
    return "|".join(
        str(part)
        for part in (
            name,
            params,
            model.dtype,
            hardware,
            attention,
            device_map_digest(model),
            torch.get_num_threads(),
            torch.__version__,
            _linears_key(model),
            _greedy_head_key(model),
        )
    )


def _greedy_head_key(model) -> str:
    if greedy_head_of(model) is None:
        return "greedy head full"
    return f"greedy head screened on {packing_engine()}, every position timed, rows narrowed by their own bounds"


def _linears_key(model) -> str:
    """How many linears ``cpu_linear`` patched, and which kernels they take (only then)."""
    count = getattr(model, "_rag_lookahead_few_token_linears", 0)
    kernels = [name for name, works in (("mkl-packed", mkl_packed_works), ("onednn", onednn_linear_works)) if works()]
    if count and model.dtype in (torch.float32, torch.bfloat16):
        kernels.append(f"packed by {packed_kernel(model.dtype)}")
    return f"few-token linears {count}{''.join(' ' + k for k in kernels) if count else ''}"


def model_devices(model) -> list[torch.device]:
    """The devices the model's weights sit on (several under an accelerate device map), in order."""
    seen: dict[str, torch.device] = {}
    for parameter in model.parameters():
        seen.setdefault(str(parameter.device), parameter.device)
    return list(seen.values())


def device_name(device: torch.device) -> str:
    """A device's hardware name: the GPU's (``NVIDIA H100 80GB HBM3``), else the CPU model and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{cpu_name()} x{torch.get_num_threads()} threads"
    return device.type


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_map_digest(model) -> str:
    """A short digest of an accelerate device map ("none" when the model sits on one device as a whole)."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return "none"
    text = json.dumps({str(k): str(v) for k, v in device_map.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def synchronize(model) -> None:
    """Wait for every accelerator the model runs on, so a timer stops after the work, not after its launch."""
    for device in model_devices(model):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "xpu" and hasattr(torch, "xpu"):
            torch.xpu.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()


def _curve_file() -> Path:
    return cache_dir() / "cost_curves.json"


@torch.inference_mode()
def measure_cost(model, *, context: int = 256, sizes=(1, 4, 8, 16, 32, 64, 128), repeats: int = 3) -> CostCurve:
    """Time forwards of each size on top of a ``context``-token cache (the fastest of ``repeats``).

    The fastest run, not the median: the curve is kept on disk, and on a shared CPU a run slowed
    by another process (OpenMP threads spinning against each other: a 4-token forward measured
    6x a 1-token one under load here) would skew every later budget decision.

    A screened output layer is timed over every position (over 48: the full layer's argmax),
    although a step's walk screens only the levels it reads: timed as a batch-1 walk (8
    positions), big forwards looked cheap, and the budget, which scales this curve to many rows
    by their plain step, drafted 32-row steps that cost more than they gained (copying set, 32
    rows: 22 draft nodes a step at 1.2 s for 53 tokens against 0.6 s for 32 plain)."""
    from rag_lookahead.decoding.verify import input_device

    device = input_device(model)
    context, sizes = _fit_window(context, sizes, context_limit(model))
    with without_cudnn_attention(device):  # the kernels the steps run on
        seconds = _fastest_forwards(model, device, context, sizes, repeats)
    for i in range(1, len(seconds)):  # more tokens never cost less; noise must not say otherwise
        seconds[i] = max(seconds[i], seconds[i - 1])
    return CostCurve(list(sizes), seconds)


def _fastest_forwards(model, device, context: int, sizes: list[int], repeats: int) -> list[float]:
    """Per size, the fastest of ``repeats`` timed forwards (after one untimed) over a random
    ``context``-token cache (see ``measure_cost``)."""
    vocab = vocab_size(model)  # (a composite model's config may hold it in its text config only)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    cache = full_cache(model)
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    synchronize(model)
    seconds = []
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), generator=generator).to(device)
        positions = torch.arange(context, context + n, device=device)[None]
        head = greedy_head_of(model)
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            with capture_hidden() if head is not None else contextlib.nullcontext() as captured:
                model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            if captured:  # every position, though a walk reads fewer: see the note above
                head.argmax(captured[-1][0]).prefetch(range(n))
            synchronize(model)
            runs.append(time.perf_counter() - start)
            cache.crop(-n)
        seconds.append(min(runs[1:]))
    return seconds


def _fit_window(context: int, sizes, limit: int | None) -> tuple[int, list[int]]:
    """The timing context and sizes cut to fit a model's window: a learned-position model (GPT-2,
    OPT) indexes past its position table otherwise (IndexError; on CUDA a device-side assert).
    At least two sizes stay, as a curve needs them; a step never verifies more than fits anyway."""
    sizes = list(sizes)
    if limit is None or context + sizes[-1] <= limit:
        return context, sizes
    kept = [n for n in sizes if n <= limit // 2] or sizes[:1]
    if len(kept) < 2:
        kept = [1, 2]
    return max(min(context, limit - kept[-1]), 1), kept


RECALIBRATE_ENV = "RAG_LOOKAHEAD_RECALIBRATE"
#: the values of RAG_LOOKAHEAD_RECALIBRATE that ask for a new measurement, and those that do not
#: (any letters; blank: as unset)
RECALIBRATE_VALUES = ("1", "true", "yes", "on")
NO_RECALIBRATE_VALUES = ("0", "false", "no", "off")


def recalibrate_asked() -> bool:
    """Whether RAG_LOOKAHEAD_RECALIBRATE asks every process to measure its curve again; ConfigError
    for a value that is neither yes nor no. Any value did before, so ``=0`` or ``=false``
    re-measured (and rewrote the stored curve) on every call; then any value but those four
    (``=y``, ``=2``, ``=enable``) was a silent no."""
    value = os.environ.get(RECALIBRATE_ENV, "").strip().lower()
    if value and value not in RECALIBRATE_VALUES + NO_RECALIBRATE_VALUES:
        raise ConfigError(
            f"{RECALIBRATE_ENV} must be 1, true, yes or on (measure the cost curve again) or 0, false, no or off, "
            f"got {os.environ[RECALIBRATE_ENV]!r}"
        )
    return value in RECALIBRATE_VALUES


def cost_curve(model) -> CostCurve:
    """The model's cost curve: measured on first use, then kept in its profile and on disk.

    The file lets a one-shot CLI call skip the measurement; delete it (or set
    RAG_LOOKAHEAD_RECALIBRATE=1) after changing hardware or when it was measured under load.
    """
    profile = profile_of(model)
    if profile.cost_curve is not None:
        return profile.cost_curve
    key = _curve_key(model)
    path = _curve_file() if key else None
    stored = _read_curves(path) if path is not None else {}
    curve = None if recalibrate_asked() else _curve_of(stored.get(key))
    if curve is None:
        curve = measure_cost(model)
        if path is not None:
            _keep_curve(path, key, curve)
    profile.cost_curve = lower_hull(curve)
    return profile.cost_curve


#: a cost file holds a few dozen numbers per model and device: anything near this is not ours
MAX_CURVES_MB = 16.0


def _read_curves(path: Path) -> dict:
    """The stored curves by key; {} when the file is missing, unreadable or not a JSON object (a FIFO
    at its name is not waited on)."""
    from rag_lookahead.file_reads import read_capped

    raw = read_capped(path, follow_symlinks=True, max_file_mb=MAX_CURVES_MB, limit_flag=None)
    try:
        stored = json.loads(raw.decode("utf-8")) if isinstance(raw, bytes) else {}
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        return {}
    return stored if isinstance(stored, dict) else {}


def _curve_of(entry) -> CostCurve | None:
    """A stored entry as a curve; None when it is not one (measured again then)."""
    if not isinstance(entry, dict) or set(entry) != {"sizes", "seconds"}:
        return None
    sizes, seconds = entry["sizes"], entry["seconds"]
    numbers = all(
        isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        for v in (sizes, seconds)
    )
    if not numbers or len(sizes) != len(seconds) or len(sizes) < 2 or sizes != sorted(set(sizes)):
        return None
    if not all(math.isfinite(n) and n == int(n) for n in sizes):  # Infinity or NaN: int() raised
        return None
    if sizes[0] < 1 or not all(math.isfinite(t) and t > 0 for t in seconds):
        return None  # no forward is free (0 s divides the budget's scaling) or NaN (it would never draft)
    return CostCurve([int(n) for n in sizes], [float(t) for t in seconds])


def _keep_curve(path: Path, key: str, curve: CostCurve) -> None:
    """Add ``curve`` to the curves file, read again under its lock so that two processes that
    measured at once both keep theirs. Only a later process's time is lost if it cannot be
    written (a read-only cache, the name taken by a folder, a lock held too long), so decoding
    goes on with a warning."""
    lock = path.with_name(path.name + ".lock")
    try:
        with exclusive(lock, CURVE_LOCK_TIMEOUT_S, on_timeout=lambda: TimeoutError(f"{lock} is held")):
            stored = _read_curves(path)
            stored.pop(key, None)  # the newest last: the oldest go first when the file is full
            stored[key] = {"sizes": curve.sizes, "seconds": curve.seconds}  # as timed
            for old in list(stored)[: max(len(stored) - MAX_STORED_CURVES, 0)]:
                del stored[old]
            write_json_atomic(path, stored)
            _remove_killed_writes(path)
    except OSError as err:  # TimeoutError is one
        log.warning("could not keep the measured cost curve in %s (%s): it is measured again next run", path, err)


def _remove_killed_writes(path: Path) -> None:
    """The temporary files ``write_json_atomic`` left beside ``path`` when a process was killed
    mid-write (``.cost_curves.json.XXXXXXXX``; nothing removed them). Called under the curves'
    lock, which every writer holds while it writes: any such file is a dead writer's."""
    remove_leftovers(path.parent, temporary_names(re.escape(path.name)))  # one that will not go: the curve is kept


class StepCosts:
    """What verify steps really cost, by (rows, tokens), correcting the batch-1 curve.

    The curve is timed for one row without a mask; rows packed together also attend over each
    other's (masked) cache columns, which costs more as rows and caches grow. So every step's
    time is remembered, and a token count not yet seen for this many rows is predicted from the
    curve scaled like the nearest count that was seen. The first step at a new row count runs
    plain (no drafts), which measures the regime at the price of one step without drafts.
    """

    def __init__(self, curve: CostCurve) -> None:
        self.curve = curve
        self.seen: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()  # calls on one model from several threads share these costs

    def __repr__(self) -> str:
        return f"StepCosts({len(self.seen)} (rows, tokens) sizes seen, over {self.curve!r})"

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        with self._lock:
            old = self.seen.get((rows, tokens))
            self.seen[(rows, tokens)] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def known(self, rows: int) -> bool:
        return (rows, rows) in self.seen

    def __call__(self, rows: int, tokens: int) -> float:
        with self._lock:
            exact = self.seen.get((rows, tokens))
            if exact is not None:
                return exact
            predicted = self.curve(tokens)
            if not self.known(rows):
                return predicted
            nearest = min((abs(t - tokens), t) for r, t in self.seen if r == rows)[1]
            return predicted * self.seen[(rows, nearest)] / self.curve(nearest)


def step_costs(model) -> StepCosts:
    """The model's measured step costs, shared by every call on it (calibrated once per batch size)."""
    profile = profile_of(model)
    if profile.step_costs is None:
        profile.step_costs = StepCosts(cost_curve(model))
    return profile.step_costs


#: A step of several rows drafts only where its expected tokens per second beat a plain step's by
#: this factor. Rows that draft finish out of step with each other, which costs what a step's own
#: estimate cannot see: freed slots are refilled a prompt or two at a time (smaller, slower
#: prefills, the other rows waiting) and the batch drains through a tail of a few rows. Measured
#: at 32 rows (default model, bf16, 2-core Xeon): drafted steps 3-10% faster than plain ones,
#: whole runs 5-11% slower; at 4-24 rows drafted steps gained 19-70%. One row is exempt.
BATCH_DRAFT_MARGIN = 1.15


def allocate(drafts: list[DraftTree], costs: StepCosts | None) -> list[int]:
    """Draft nodes per row for one forward over all rows, best expected tokens per second.

    Rows are packed side by side, so a node costs the same wherever it sits: one more token in
    the forward. The nodes of all rows are therefore ranked together by their chance of
    acceptance (weighed by each row's ``AcceptanceRates``), and the best prefix of that ranking
    wins: with k nodes a step costs ``costs(rows, rows + k)`` and gains the rows' bonus tokens
    plus the k chances. A row's share is its k_r likeliest nodes, still a tree. As the batch
    grows each step costs more and fewer nodes pay; where none does, or (several rows) where the
    best gains less than ``BATCH_DRAFT_MARGIN`` over a plain step, the step is plain decoding.
    """
    if costs is None:
        return [len(d) for d in drafts]  # fixed budget: every candidate
    rows = len(drafts)
    counts = [0] * rows
    if not any(len(d) for d in drafts) or not costs.known(rows):
        return counts  # nothing to draft, or a new batch size: measure its plain step first
    ranked = sorted(((p, r) for r, d in enumerate(drafts) for p in d.probs), reverse=True)
    plain_rate = rows / costs(rows, rows)
    gain, best_k, best_rate = float(rows), 0, plain_rate
    for k, (value, _) in enumerate(ranked, start=1):
        gain += value
        rate = gain / costs(rows, rows + k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    if rows > 1 and best_rate < BATCH_DRAFT_MARGIN * plain_rate:
        return counts
    for _, r in ranked[:best_k]:
        counts[r] += 1
    return counts
