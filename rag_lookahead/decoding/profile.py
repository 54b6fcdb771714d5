"""What the decode loop learns about one model and reuses on every call: one object per model.

Some facts cost forwards to find out and stay true for every call on a model: whether its
attention honours a tree mask (``verify.supports_tree_mask`` probes it), what a forward of n
tokens costs (``costs.cost_curve`` times it, and keeps it on disk too), what real verify steps
cost at each batch size (``costs.step_costs`` learns it), and the pool of earlier answers that
calls bringing none of their own share (``loop.generate``). They all live in the model's
``ModelProfile``, held weakly (dropping the model drops its profile), so one place shows what
is known about a model (``as_dict``) and one call forgets it (``reset``): after moving the
model to another device, or between tests (a changed attention kernel is noticed: see
``tree_mask_attention``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rag_lookahead.decoding.acceptance import AcceptanceRates
    from rag_lookahead.decoding.costs import CostCurve, StepCosts
    from rag_lookahead.decoding.trie import OutputPool

__all__ = ["ModelProfile", "profile_of"]


@dataclass(eq=False)
class ModelProfile:
    """Everything measured or accumulated for one model; None (or empty) until first needed.

    tree_mask: the mask probe's verdict (True: rows and tree branches can share a forward).
    tree_mask_reason: why not, when the verdict is False.
    tree_mask_attention: the attention implementation the verdict was reached under: one set
        since (``set_attn_implementation``) is judged again.
    cost_curve: seconds of a batch-1 forward by token count.
    step_costs: measured verify-step seconds by (rows, tokens), correcting the curve.
    output_pools: the shared pools of earlier answers, one per (trie depth, node cap): a call
        with a deeper config never reads a shallower pool (or the reverse), and a call's
        ``output_pool_nodes`` bounds the pool it writes to.
    drafts_met: per kind of drafter, how its drafts have been accepted lately over every call
        on the model: where a new row's acceptance rates start, so a call's first step does
        not verify its deepest trees on trust alone.
    costs_set_aside: the costs of a layout switched away from, by its name (benchmarks switch
        the output layer back and forth: ``greedy_head.full_output_layer``).
    position_origin: the position the model numbers a prompt's first token (``positions``).
    attends_ahead: whether a model whose config says ``is_decoder=False`` attends both ways (``causality``).
    fed_whole_sequence: whether ``generate`` feeds the model every token on every step (``generate_inputs``).
    """

    tree_mask: bool | None = None
    tree_mask_reason: str | None = None
    tree_mask_attention: str | None = None
    cost_curve: CostCurve | None = None
    step_costs: StepCosts | None = None
    output_pools: dict[tuple[int, int], OutputPool] = field(default_factory=dict)
    drafts_met: dict[str, AcceptanceRates] = field(default_factory=dict)
    costs_set_aside: dict[str, tuple[CostCurve | None, StepCosts | None]] = field(default_factory=dict)
    position_origin: int | None = None
    attends_ahead: bool | None = None
    fed_whole_sequence: bool | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def output_pool(self, depth: int, max_nodes: int) -> OutputPool:
        """The pool of earlier answers shared by calls at this trie depth and node cap (made on first use)."""
        from rag_lookahead.decoding.trie import OutputPool

        with self._lock:
            pool = self.output_pools.get((depth, max_nodes))
            if pool is None:
                pool = self.output_pools[(depth, max_nodes)] = OutputPool(depth, max_nodes)
            return pool

    def acceptance(self, drafter: str, new: Callable[[], AcceptanceRates]) -> AcceptanceRates:
        """The rates ``drafter``'s drafts have met on this model (made by ``new`` on first use)."""
        with self._lock:
            rates = self.drafts_met.get(drafter)
            if rates is None:
                rates = self.drafts_met[drafter] = new()
            return rates

    def forget_costs(self) -> None:
        """Forget the forward costs (curve and step costs): the layers' kernels changed
        (``cpu_linear``, ``greedy_head``), so the next call measures or reloads them under its own key."""
        with self._lock:
            self.cost_curve = None
            self.step_costs = None

    def reset(self) -> None:
        """Forget everything: the next call probes, measures and pools afresh (the cost file on disk stays)."""
        with self._lock:
            self.tree_mask = None
            self.tree_mask_reason = None
            self.tree_mask_attention = None
            self.cost_curve = None
            self.step_costs = None
            self.output_pools = {}
            self.drafts_met = {}
            self.costs_set_aside = {}
            self.position_origin = None
            self.attends_ahead = None
            self.fed_whole_sequence = None

    def as_dict(self) -> dict:
        """A plain summary for logs and debugging."""
        curve = self.cost_curve
        return {
            "tree_mask": self.tree_mask,
            "tree_mask_reason": self.tree_mask_reason,
            "position_origin": self.position_origin,
            "cost_curve": None if curve is None else dict(zip(curve.sizes, curve.seconds)),
            "step_costs_seen": None if self.step_costs is None else len(self.step_costs.seen),
            "output_pools": [
                {"depth": depth, "max_nodes": cap, "nodes": pool.nodes}
                for (depth, cap), pool in sorted(self.output_pools.items())
            ],
            "drafts_met": {name: repr(rates) for name, rates in sorted(self.drafts_met.items())},
        }


_PROFILES: weakref.WeakKeyDictionary[torch.nn.Module, ModelProfile] = weakref.WeakKeyDictionary()
_PROFILES_LOCK = threading.Lock()


def profile_of(model) -> ModelProfile:
    """The model's profile, made empty on first use."""
    with _PROFILES_LOCK:
        profile = _PROFILES.get(model)
        if profile is None:
            profile = _PROFILES[model] = ModelProfile()
        return profile
