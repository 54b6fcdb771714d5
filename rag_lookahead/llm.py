"""LookaheadLLM: a LangChain ``BaseLLM`` over the lossless lookahead ``generate``.

    llm = LookaheadLLM.from_model_id("default", max_new_tokens=256)
    llm.invoke("什么是前瞻解码？")
    llm.batch(["q1", "q2"])                      # one batched generate() call for all prompts
    for piece in llm.stream("q"): print(piece, end="")
    llm.invoke(prompt, references=["passage that is not in the prompt", ...])

Each prompt is wrapped in the tokenizer's chat template (prompt as the user turn, optional system
prompt); only the answer text comes back. Greedy by default; ``temperature > 0`` samples (also
``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``, as fields or per call). Either
way the text is the same with lookahead on or off (``enable_lookahead=False`` per call; for
sampling, under the same ``seed``), only the speed differs.

``references`` (per call): passages that seed the row's draft trie without being in the prompt,
one list of strings per prompt (a flat list of strings is accepted for a single prompt).
Passages may also be registered ahead with :meth:`LookaheadLLM.register_seeds` (used by
:class:`rag_lookahead.chains.SeedingRetriever` for ``RetrievalQA``, whose chain cannot pass
per-query kwargs to the LLM).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field, PrivateAttr

from .config import LookaheadConfig
from .errors import ConfigError, InputError
from .trie import OutputPool

__all__ = ["LookaheadLLM"]

_REPLACEMENT = "\ufffd"
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
_SEED_SLOTS = 256


class _TextTracker:
    """Turns a row's accepted token blocks into stable text pieces, honouring stop strings.

    The whole answer so far is decoded each time and only the new suffix is emitted, so a
    multi-byte character split over tokens is never emitted half (a trailing U+FFFD is held
    back), and text that might be the start of a stop string is held back until it is decided.
    """

    def __init__(self, tokenizer, stop: Sequence[str] | None, eos: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.eos = eos
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def text(self) -> str:
        ids = [t for t in self.ids if t not in self.eos]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self) -> str:
        return _cut_at_stop(self.text(), self.stop)

    def add(self, tokens: Sequence[int]) -> str:
        """Take a block of accepted tokens; return the newly stable text (may be "")."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in tokens)
        text = self.text()
        cut = _cut_at_stop(text, self.stop)
        if len(cut) < len(text) or any(s in text for s in self.stop):
            self.stopped = True
            stable = cut
        else:
            stable = text.rstrip(_REPLACEMENT)
            stable = stable[: len(stable) - _held_back(stable, self.stop)]
        if not stable.startswith(self.emitted) or len(stable) <= len(self.emitted):
            return ""
        piece = stable[len(self.emitted) :]
        self.emitted = stable
        return piece

    def rest(self) -> str:
        """What is left to emit once the row is done: the final text minus what was emitted."""
        final = self.final_text()
        piece = final[len(self.emitted) :] if final.startswith(self.emitted) else ""
        self.emitted = final
        return piece


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class LookaheadLLM(BaseLLM):
    """A local causal LM decoded greedily with trie-drafted, tree-verified lookahead."""

    model: Any = Field(default=None, exclude=True)
    tokenizer: Any = Field(default=None, exclude=True)
    model_name: str = "custom"
    lookahead: LookaheadConfig = Field(default_factory=LookaheadConfig)
    max_new_tokens: int = 256
    system_prompt: str | None = None
    temperature: float | None = None
    """None or 0: greedy. Above 0: sample (lossless: the model's own sampling distribution)."""
    top_k: int | None = None
    """Sampling: keep the k likeliest tokens (None: the model's generation config, else 50; 0: off)."""
    top_p: float | None = None
    """Sampling: nucleus mass (None: the model's generation config, else 1.0)."""
    min_p: float | None = None
    """Sampling: drop tokens below min_p times the top probability."""
    repetition_penalty: float | None = None
    """Applied at every tree node, greedy or sampled (None: the model's generation config, else 1.0)."""
    seed: int | None = None
    """Sampling: a fixed seed makes each answer reproducible, whatever else is in the batch."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    _output_pool: Any = PrivateAttr(default=None)
    _seeds: Any = PrivateAttr(default=None)
    _seed_lock: Any = PrivateAttr(default=None)
    _eos: Any = PrivateAttr(default=None)

    def model_post_init(self, __context: Any) -> None:
        if self.model is None or self.tokenizer is None:
            raise ConfigError("LookaheadLLM needs a model and a tokenizer (or use LookaheadLLM.from_model_id)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.lookahead.stop_words:
            self.lookahead = self.lookahead.with_tokenizer(self.tokenizer)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._sampling({})  # refuse bad sampling settings at construction
        cfg = self.lookahead
        self._output_pool = OutputPool(cfg.branch_length + cfg.max_key_length, cfg.output_pool_nodes)
        self._seeds = OrderedDict()
        self._seed_lock = threading.Lock()
        self._eos = frozenset(_eos_ids(self.model, self.tokenizer))

    # ------------------------------------------------------------ construction

    @classmethod
    def from_model_id(
        cls,
        model_id: str = "default",
        *,
        lookahead: LookaheadConfig | None = None,
        max_new_tokens: int = 256,
        system_prompt: str | None = None,
        dtype: Any = None,
        device: Any = None,
        device_map: Any = None,
        **kwargs: Any,
    ) -> "LookaheadLLM":
        """Load ``model_id`` ("default", a hub id or a local path) with :func:`rag_lookahead.models.load_model`."""
        from .models import load_model

        model, tokenizer = load_model(model_id, dtype=dtype, device=device, device_map=device_map)
        name = "qwen2.5-coder-0.5b-instruct" if model_id == "default" else str(model_id)
        return cls(
            model=model,
            tokenizer=tokenizer,
            model_name=name,
            lookahead=lookahead or LookaheadConfig(),
            max_new_tokens=max_new_tokens,
            system_prompt=system_prompt,
            **kwargs,
        )

    # ------------------------------------------------------------ LangChain plumbing

    @property
    def _llm_type(self) -> str:
        return "rag_lookahead"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        # only what changes the text: draft settings change speed, never output, so the cache is shared
        params = {"model_name": self.model_name, "max_new_tokens": self.max_new_tokens, "system_prompt": self.system_prompt}
        return params | {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}

    @property
    def output_pool(self) -> OutputPool:
        return self._output_pool

    # ------------------------------------------------------------ seeds registered ahead (RetrievalQA)

    def register_seeds(self, anchors: Sequence[str], passages: Sequence[str]) -> None:
        """Seed any later prompt that contains every string in ``anchors`` with ``passages``.

        Used when the chain cannot pass ``references`` to the LLM (``RetrievalQA``): the retriever
        registers the passages it kept out of the prompt, keyed by the ones it put in.
        """
        anchors = tuple(a for a in anchors if a)
        passages = [p for p in passages if p]
        if not anchors or not passages:
            return
        with self._seed_lock:
            self._seeds[anchors] = passages
            self._seeds.move_to_end(anchors)
            while len(self._seeds) > _SEED_SLOTS:
                self._seeds.popitem(last=False)

    def _registered_seeds(self, prompt: str) -> list[str]:
        with self._seed_lock:
            for anchors in reversed(self._seeds):
                if all(a in prompt for a in anchors):
                    return list(self._seeds[anchors])
        return []

    # ------------------------------------------------------------ encoding

    def _encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("the prompt is empty: give the model a question or an instruction")
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        text = (self.system_prompt + "\n\n" if self.system_prompt else "") + prompt
        return list(self.tokenizer(text)["input_ids"])

    def _references(self, prompts: Sequence[str], references: Any) -> list[list[list[int]]]:
        if references is None:
            rows: list[list[str]] = [[] for _ in prompts]
        elif isinstance(references, str):
            raise InputError("references must be a list of passages (strings), one list per prompt")
        else:
            references = list(references)
            if references and all(isinstance(r, str) for r in references):
                if len(prompts) != 1:
                    raise InputError(
                        f"references is one list of passages but there are {len(prompts)} prompts: give one list per prompt"
                    )
                references = [references]
            if len(references) != len(prompts):
                raise InputError(f"references has {len(references)} lists but there are {len(prompts)} prompts")
            rows = []
            for r in references:
                if r is None:
                    r = []
                if isinstance(r, str) or not all(isinstance(p, str) for p in r):
                    raise InputError("each entry of references must be a list of passages (strings)")
                rows.append(list(r))
        out = []
        for prompt, passages in zip(prompts, rows):
            passages = passages or self._registered_seeds(prompt)
            out.append([self.tokenizer.encode(p, add_special_tokens=False) for p in passages if p])
        return out

    def _config(self, kwargs: dict) -> LookaheadConfig:
        enable = kwargs.pop("enable_lookahead", None)
        config = kwargs.pop("lookahead", None) or self.lookahead
        if not isinstance(config, LookaheadConfig):
            raise ConfigError("lookahead must be a LookaheadConfig")
        if enable is not None:
            config = config.replace(enabled=bool(enable))
        return config

    def _sampling(self, kwargs: dict) -> dict:
        """``generate``'s sampling keywords: the fields, overridden per call; pops what it uses."""
        from .sampling import resolve_sampling

        values = {name: kwargs.pop(name, getattr(self, name)) for name in _SAMPLING_FIELDS}
        temperature = values.pop("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0):
            raise ConfigError(f"temperature must be a number >= 0, got {temperature!r}")
        sample = bool(temperature)
        options = {"do_sample": sample, "temperature": temperature if sample else None, **values}
        seed = options.pop("seed")
        resolve_sampling(self.model, **options)  # raises ConfigError on a bad value
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
        return options | {"seed": seed}

    def _run(self, prompts: Sequence[str], stop, kwargs: dict, on_block=None):
        """One batched ``generate`` over ``prompts``; ``on_block(row, tokens)`` sees each accepted block.

        Returns (trackers, per-row step counts, GenerationResult).
        """
        from .generate import generate, left_pad

        kwargs = dict(kwargs)
        config = self._config(kwargs)
        max_new = kwargs.pop("max_new_tokens", None) or self.max_new_tokens
        references = self._references(prompts, kwargs.pop("references", None))
        cancel: threading.Event | None = kwargs.pop("_cancel", None)
        sampling = self._sampling(kwargs)
        if kwargs:
            raise ConfigError(
                f"unknown option(s) for LookaheadLLM: {', '.join(sorted(kwargs))} (known: max_new_tokens, references, "
                f"enable_lookahead, lookahead, {', '.join(_SAMPLING_FIELDS)})"
            )
        encoded = [self._encode(p) for p in prompts]
        pad = self.tokenizer.pad_token_id
        ids, mask = left_pad(encoded, pad)
        trackers = [_TextTracker(self.tokenizer, stop, self._eos) for _ in prompts]
        steps = [0] * len(prompts)

        def on_tokens(row: int, tokens: list[int]) -> bool:
            steps[row] += 1
            tracker = trackers[row]
            piece = tracker.add(tokens)
            if on_block is not None:
                on_block(row, tokens, piece)
            return tracker.stopped or (cancel is not None and cancel.is_set())

        result = generate(
            self.model,
            ids,
            mask,
            max_new_tokens=max_new,
            config=config,
            references=references if any(references) else None,
            eos_token_id=sorted(self._eos),
            pad_token_id=pad,
            output_pool=self._output_pool,
            on_tokens=on_tokens,
            **sampling,
        )
        return trackers, steps, result

    def _info(self, tracker: _TextTracker, steps: int, stats, lookahead: bool) -> dict:
        tokens = len(tracker.ids)
        decode_steps = max(steps - 1, 0)  # the first block comes from the prefill
        return {
            "new_tokens": tokens,
            "forward_passes": decode_steps,
            "mean_accepted": round((tokens - 1) / decode_steps, 4) if decode_steps else 0.0,
            "tokens_per_second": round(stats.decode_tokens_per_second, 3),
            "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4),
            "batch_size": stats.rows,
            "stopped_by": "stop" if tracker.stopped else ("eos" if tracker.ids and tracker.ids[-1] in self._eos else "length"),
            "lookahead": lookahead,
        }

    # ------------------------------------------------------------ BaseLLM hooks

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if not prompts:
            return LLMResult(generations=[])
        on_block = None
        if run_manager is not None and len(prompts) == 1:

            def on_block(row: int, tokens: list[int], piece: str) -> None:
                if piece:
                    run_manager.on_llm_new_token(piece)

        enabled = self._config(dict(kwargs)).enabled
        trackers, steps, result = self._run(prompts, stop, kwargs, on_block)
        generations = []
        for tracker, n in zip(trackers, steps):
            text = tracker.final_text()
            if on_block is not None:
                rest = tracker.rest()
                if rest:
                    run_manager.on_llm_new_token(rest)
            generations.append([Generation(text=text, generation_info=self._info(tracker, n, result.stats, enabled))])
        return LLMResult(generations=generations, llm_output={"stats": result.stats.as_dict(), "model_name": self.model_name})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        """Chunks as blocks are accepted. Intermediate chunks carry no generation_info (LangChain
        merges chunk infos key by key and keeps equal ints instead of summing them, so partial
        counters cannot add up); the last chunk carries all the stats."""
        enabled = self._config(dict(kwargs)).enabled
        self._encode(prompt)  # fail fast, in the caller's thread
        cancel = threading.Event()
        feed: queue.Queue = queue.Queue()
        box: dict = {}

        def on_block(row: int, tokens: list[int], piece: str) -> None:
            if piece:
                feed.put(("piece", piece))

        def work() -> None:
            try:
                box["out"] = self._run([prompt], stop, {**kwargs, "_cancel": cancel}, on_block)
            except BaseException as e:  # handed to the consumer
                box["error"] = e
            finally:
                feed.put(("done", None))

        worker = threading.Thread(target=work, name="lookahead-stream", daemon=True)
        worker.start()
        try:
            while True:
                kind, piece = feed.get()
                if kind == "done":
                    break
                chunk = GenerationChunk(text=piece)
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        finally:
            cancel.set()
            worker.join()
        if "error" in box:
            raise box["error"]
        trackers, steps, result = box["out"]
        rest = trackers[0].rest()
        chunk = GenerationChunk(text=rest, generation_info=self._info(trackers[0], steps[0], result.stats, enabled))
        if rest and run_manager is not None:
            run_manager.on_llm_new_token(rest, chunk=chunk)
        yield chunk


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen, int):
        ids.add(gen)
    elif gen is not None:
        ids.update(int(t) for t in gen)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
