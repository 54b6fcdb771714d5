"""The settings :class:`LookaheadLLM` and :class:`ChatLookahead` share, declared and checked once.

Both models take the same sampling fields (as fields, or per call), turn them into ``generate``'s
keywords the same way, and hand our own :class:`ConfigError` back to the caller instead of the
``ValidationError`` pydantic wraps it in. A field changed after construction (``model_copy(update=...)``
or plain assignment) is checked and settled as the constructor does it, and a call configured through
``configurable_fields`` decodes with the model's engine, as a ``model_copy`` does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from langchain_core.runnables.configurable import RunnableConfigurableFields
from pydantic import BaseModel, PrivateAttr, StrictFloat, StrictInt, ValidationError

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.errors import ConfigError, InputError

__all__ = ["SAMPLING_FIELDS", "SamplingFields", "resolve_config", "sampling_options", "settings_error"]

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


class SamplingFields(BaseModel):
    """Sampling fields (greedy unless ``temperature > 0``), each overridable per call by a keyword
    of the same name, and the construction that refuses bad settings with our own errors. The
    numbers are strict (no ``True`` for 1, ``"0.5"`` for 0.5, ``1.5`` cut to 1), as per call."""

    temperature: StrictFloat | None = None
    """None or 0: greedy. Above 0: sample (lossless: the model's own sampling distribution)."""
    top_k: StrictInt | None = None
    """Sampling: keep the k likeliest tokens (None: the model's generation config, else 50; 0: off)."""
    top_p: StrictFloat | None = None
    """Sampling: nucleus mass (None: the model's generation config, else 1.0)."""
    min_p: StrictFloat | None = None
    """Sampling: drop tokens below min_p times the top probability."""
    repetition_penalty: StrictFloat | None = None
    """Applied at every tree node, greedy or sampled (None: the model's generation config, else 1.0)."""
    seed: StrictInt | None = None
    """Sampling: a fixed seed makes each answer reproducible, whatever else is in the batch."""

    _engine: Any = PrivateAttr(default=None)  # the Engine the model decodes with (set in model_post_init)
    # whether assigning a field goes through model_copy's checks (off while the model is built or settled)
    _assignment_checked: bool = PrivateAttr(default=False)
    # one checked assignment at a time: each settles a copy of every field and writes them all back,
    # so two threads assigning different fields at once could revert one (a copy gets its own lock)
    _assignment_lock: Any = PrivateAttr(default_factory=threading.RLock)

    #: fields whose change needs another engine (the model it decodes with)
    engine_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:  # pydantic wraps our ConfigError: hand it over as raised
            raise settings_error(type(self).__name__, err) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy with ``update`` checked as the constructor checks it. Pydantic's copy checks
        nothing and keeps the copied object's engine: a copy with another ``model`` decoded with the
        old one, a ``timeout`` of -1 cut answers to a token."""
        copied = super().model_copy(update=update, deep=deep)
        if update:
            with copied._assigning_unchecked():
                try:
                    for name, value in update.items():
                        self.__pydantic_validator__.validate_assignment(copied, name, value)
                except ValidationError as err:
                    raise settings_error(type(self).__name__, err) from None
                copied._settle(frozenset(update))
        return copied

    def configurable_fields(self, **kwargs: Any) -> Any:
        """LangChain's, except that a configured call decodes with this model's engine (its weights'
        one decode at a time, its output pool), as a :meth:`model_copy` does. LangChain rebuilds the
        model from its fields for each configured call, and a ``LookaheadLLM`` so rebuilt made an
        engine of its own: its forwards ran at once with this model's on the same weights, drafting
        from an empty pool. A configured ``model`` or ``tokenizer`` still decodes with its own."""
        configured = super().configurable_fields(**kwargs)
        return _SameEngineFields(default=configured.default, fields=configured.fields)

    def __copy__(self) -> Any:
        """A shallow copy (``copy.copy``, ``model_copy``) with its own assignment lock."""
        copied = super().__copy__()
        if copied.__pydantic_private__ is not None:
            copied.__pydantic_private__["_assignment_lock"] = threading.RLock()
        return copied

    def __setattr__(self, name: str, value: Any) -> None:
        """A field assigned after construction is checked and settled as :meth:`model_copy` does
        (on a copy, taken over only if it passes): pydantic's plain assignment checked nothing and
        kept the engine, so ``llm.model = other`` went on decoding with the old model, a ``timeout``
        of -1 cut every answer to a token, and ``system_prompt = 5`` was taken. Under the instance's
        lock: the copy is settled from every field and all of them are written back, so another
        thread's assignment between the two was reverted. (A call meanwhile reads the engine once,
        so it decodes with one engine and its tokenizer.)"""
        private = getattr(self, "__pydantic_private__", None) or {}
        if name not in type(self).model_fields or not private.get("_assignment_checked"):
            super().__setattr__(name, value)
            return
        with private["_assignment_lock"]:
            settled = self.model_copy(update={name: value})
            self.__dict__.update(settled.__dict__)
            self.__pydantic_fields_set__.update(settled.__pydantic_fields_set__)
            self.__pydantic_private__.update(
                (key, held) for key, held in settled.__pydantic_private__.items() if key != "_assignment_lock"
            )

    @contextlib.contextmanager
    def _assigning_unchecked(self) -> Iterator[None]:
        """Plain assignment while the settings are checked and settled (``_settle`` writes the values it
        works out, pydantic's validators write fields), checked assignment after."""
        self._assignment_checked = False
        try:
            yield
        finally:
            self._assignment_checked = True

    def _settle_built(self) -> None:
        """Settle the settings of a model just built; from then on an assigned field is checked."""
        with self._assigning_unchecked():
            self._settle(None)

    def _settle(self, updated: frozenset[str] | None) -> None:
        """Check the settings, and build the engine at construction (``updated`` None) or after a
        :meth:`model_copy` (or an assignment) that updated one of ``engine_fields``."""
        raise NotImplementedError

    def _new_engine(self, updated: frozenset[str] | None) -> bool:
        return updated is None or bool(self.engine_fields & updated)

    def _sampling(self, kwargs: dict, engine: Any = None) -> dict:
        """``generate``'s sampling keywords for ``engine``'s model (the call's; by default the current
        engine's): the fields, overridden per call; pops what it uses."""
        values = {name: kwargs.pop(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        return sampling_options((self._engine if engine is None else engine).model, values)

    def _sampling_params(self) -> dict[str, Any]:
        """The sampling fields that are set, for ``_identifying_params`` (they change the text)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


class _SameEngineFields(RunnableConfigurableFields):
    """``configurable_fields`` of our models: the model LangChain rebuilds for a configured call
    takes the engine of the model it was built from when it decodes the same model with the same
    tokenizer (the engine is read once, so an assignment meanwhile cannot pair it with another)."""

    def _prepare(self, config: Any = None) -> tuple[Any, Any]:
        engine = self.default._engine
        runnable, config = super()._prepare(config)
        own = getattr(runnable, "_engine", None)
        if runnable is not self.default and own is not None:
            if own.model is engine.model and own.tokenizer is engine.tokenizer:
                runnable._engine = engine
        return runnable, config


def resolve_config(default: LookaheadConfig, kwargs: dict) -> LookaheadConfig:
    """The draft settings of one call: ``lookahead=`` and ``enable_lookahead=`` (popped) over ``default``."""
    enable = kwargs.pop("enable_lookahead", None)
    config = kwargs.pop("lookahead", None) or default
    if not isinstance(config, LookaheadConfig):
        raise ConfigError("lookahead must be a LookaheadConfig")
    if enable is not None:
        if not isinstance(enable, bool):  # "False" read as on
            raise ConfigError(f"enable_lookahead must be True or False, got {enable!r}")
        config = config.replace(enabled=enable)
    return config


def sampling_options(model, values: Mapping[str, Any]) -> dict:
    """``generate``'s sampling keywords from our fields (temperature None or 0: greedy).

    Bad values raise :class:`ConfigError` here, before any decoding.
    """
    from rag_lookahead.decoding.sampling import check_seed, check_warpers, resolve_sampling

    values = dict(values)
    temperature = values.pop("temperature", None)
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0
    ):
        raise ConfigError(f"temperature must be a number >= 0, got {temperature!r}")
    sample = bool(temperature)
    # as strict per call as the fields are (README: True, "0.5" or top_k=1.5 are refused), greedy or not:
    # resolve_sampling float()s what it is given, so "0.9" or True passed for top_p / min_p /
    # repetition_penalty, and greedy skipped the warpers' checks (top_p=1.5 was taken by a greedy
    # model and refused at its first sampled call)
    penalty = values.get("repetition_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))):
        raise ConfigError(f"repetition_penalty must be a number, got {penalty!r}")
    check_warpers(top_p=values.get("top_p"), min_p=values.get("min_p"), top_k=values.get("top_k"))
    seed = values.pop("seed", None)
    # a field left at None is not given (the model's own setting holds); to the core None means "off"
    options = {"do_sample": sample, "temperature": temperature, **values} if sample else {"do_sample": False, **values}
    options = {name: value for name, value in options.items() if value is not None}
    resolve_sampling(model, **options)  # raises ConfigError on a bad value
    check_seed(seed)  # the bound too: 2**64 was taken here and refused by every call
    return options | {"seed": seed}


def settings_error(owner: str, err: Exception) -> Exception:
    """Our own error back out of pydantic's wrapping, or a one-line :class:`ConfigError`.

    Pydantic wraps a ``ValueError`` raised while a model is built (our ``ConfigError`` is one)
    into a multi-line ``ValidationError``; callers should get the error we raised.
    """
    details = err.errors() if hasattr(err, "errors") else []
    for detail in details:
        original = (detail.get("ctx") or {}).get("error")
        if isinstance(original, (ConfigError, InputError)):
            return original
    if details:
        where = ".".join(str(part) for part in details[0].get("loc", ())) or "settings"
        return ConfigError(f"invalid {owner} setting {where}: {details[0].get('msg', err)}")
    return err
