"""Noticing a weight edited behind its version counter, before a forward computes with an old copy.

Why: the packed linears (``cpu_linear``) and the output layer's screen (``greedy_head``) compute
from copies of the weights, and they told a stale copy by the weight's version counter and
storage only (:func:`~rag_lookahead.cpu_linear.weight_stamp`). An edit through ``weight.data``
(``weight.data += delta`` is how peft's ``merge_and_unload`` merges a LoRA adapter by default;
``weight.data.copy_(...)`` too) bumps neither: the model kept computing with the weights it had
before the merge, in ``model.generate`` and ``model(...)`` as much as in ours.

So each copy also keeps a few of its weight's values (:class:`ValueSample`: ``SAMPLE_SIZE`` bit
patterns spread over the rows and columns, read through a view of the weight's own storage).
A forward pre-hook on the model compares the samples of all its packed linears at once before
every forward (one concatenation and one comparison: ~0.2 ms for the default model's 168 on a
2-core CPU), and the screen compares its own before each greedy step. A copy whose values moved
is dropped and made again from the weight as it is. A dense edit (a merged adapter, a rescaled
layer) changes every sampled value; an edit of a few rows or columns through ``.data`` may miss
the sample: call :func:`forget_weight_copies` after one.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

__all__ = ["SAMPLE_SIZE", "ValueSample", "WeightWatch", "forget_weight_copies", "watch_of"]

#: Values sampled per weight (fewer where the weight has fewer rows).
SAMPLE_SIZE = 64

_ATTR = "_rag_lookahead_weight_watch"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ValueSample:
    """Some of a 2-D weight's values as they are now, and a view that reads them as they will be.

    Bit patterns, not values: a NaN equals itself, and -0.0 differs from 0.0, as in the copy.
    The view holds the weight's storage, so the weight is also held to that storage
    (:meth:`moved`): a model turned to another dtype or device gets new storage for every weight,
    and a sample of the old one would keep it in memory for nothing."""

    def __init__(self, weight: torch.Tensor, size: int = SAMPLE_SIZE) -> None:
        self._weight = weakref.ref(weight)
        self._storage = weight.data_ptr()
        rows, cols = weight.shape
        count = max(1, min(size, rows))
        col_step = (cols - 1) // (count - 1) if count > 1 else 0  # the last sampled column stays in its row
        stride = (rows // count) * weight.stride(0) + col_step * weight.stride(1)
        view = weight.detach().as_strided((count,), (stride,), weight.storage_offset())
        self.view = view.view(_BITS[view.element_size()])
        self.kept = self.view.clone()

    def unchanged(self) -> bool:
        return not self.moved() and torch.equal(self.view, self.kept)

    def moved(self) -> bool:
        """Whether the weight is gone or holds other storage (``.to(dtype or device)``, ``.data = ...``)."""
        weight = self._weight()
        return weight is None or weight.data_ptr() != self._storage


class WeightWatch:
    """A model's copies of weights, each with the sample of the values it was made from; checked
    before every forward. An owner is an object with ``forget_copies()``, held weakly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[weakref.ref, ValueSample]] = {}
        self._joined: tuple[list[ValueSample], list[torch.Tensor], torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self):  # a copied or pickled model starts with no copies to watch
        return WeightWatch, ()

    def watch(self, owner: object, weight: torch.Tensor) -> None:
        """``owner`` made its copy from ``weight``'s values as they are now (again: replaces its entry)."""
        sample = ValueSample(weight)
        key = id(owner)
        with self._lock:
            if key not in self._entries:
                weakref.finalize(owner, self._unwatch, key)
            self._entries[key] = (weakref.ref(owner), sample)
            self._joined = None

    def check(self) -> int:
        """Drop every copy whose weight's sampled values moved; returns how many were dropped."""
        if not self._entries:
            return 0
        samples, views, kept = self._joined or self._join()
        if not samples or (not any(sample.moved() for sample in samples) and torch.equal(torch.cat(views), kept)):
            return 0  # (none: another thread dropped them all since the test above)
        with self._lock:
            stale = [key for key, (_, sample) in self._entries.items() if not sample.unchanged()]
        return self._drop(stale)

    def before_forward(self, module: nn.Module, args: tuple) -> None:
        self.check()  # (a pre-hook's return value would replace the forward's arguments)

    def forget_all(self) -> int:
        """Drop every watched copy (each is made again from its weight when next used)."""
        with self._lock:
            keys = list(self._entries)
        return self._drop(keys)

    def _drop(self, keys: list[int]) -> int:
        with self._lock:
            owners = [self._entries.pop(key)[0]() for key in keys if key in self._entries]
            self._joined = None
        for owner in owners:
            if owner is not None:
                owner.forget_copies()
        return len(owners)

    def _unwatch(self, key: int) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._joined = None

    def _join(self) -> tuple[list[ValueSample], list[torch.Tensor], torch.Tensor]:
        with self._lock:
            samples = [sample for _, sample in self._entries.values()]
            # weights of several dtypes: torch.cat widens their bit patterns alike on both sides
            kept = torch.cat([s.kept for s in samples]) if samples else torch.empty(0)
            self._joined = (samples, [s.view for s in samples], kept)
            return self._joined


def watch_of(model: nn.Module) -> WeightWatch:
    """The model's watch, made (and its check hooked in before every forward) on first use."""
    watch = getattr(model, _ATTR, None)
    if watch is None:
        watch = WeightWatch()
        setattr(model, _ATTR, watch)
        model.register_forward_pre_hook(watch.before_forward)
    return watch


def forget_weight_copies(model: nn.Module) -> int:
    """Drop every copy rag_lookahead made of the model's weights (packed linears, the output
    layer's screen): each is made again from its weight as it is when next used. For an edit of a
    few rows or columns through ``.data``, which the sampled check may not see; returns how many
    copies were dropped."""
    from rag_lookahead.greedy_head import forget_screen

    watch = getattr(model, _ATTR, None)
    return (0 if watch is None else watch.forget_all()) + forget_screen(model)
