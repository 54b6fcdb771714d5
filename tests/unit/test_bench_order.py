"""The benchmarks turn the order of their methods from one prompt (or level) to the next, so that
no method always runs first or last on a machine whose speed drifts within minutes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer

from rag_lookahead.bench.common import rotated
from rag_lookahead.decoding.config import LookaheadConfig


@given(st.lists(st.integers(), unique=True, max_size=8), st.integers(-50, 50))
def test_a_rotation_keeps_every_item_once_and_each_comes_first_in_turn(items, shift):
    turned = rotated(items, shift)
    assert sorted(turned) == sorted(items)
    if items:
        firsts = [rotated(items, shift + k)[0] for k in range(len(items))]
        assert sorted(firsts) == sorted(items)


def test_bench_runs_each_method_first_on_some_prompt_and_reports_rows_in_the_order_asked():
    from rag_lookahead.bench.single import BenchSettings, MethodRunner, measure

    calls: list[tuple[str, str]] = []

    class Recording(MethodRunner):  # the real runner (tiny model, real decoding), noting the order
        def run(self, method, prompt, repeat=-1):
            calls.append((prompt["id"], method))
            return super().run(method, prompt, repeat)

    methods = ("greedy", "prompt_lookup", "lookahead")
    prompts = [{"id": f"p{i}", "context": "t5 t6 t7 t8 t5 t6", "question": f"t{9 + i} t5"} for i in range(3)]
    settings = BenchSettings(
        "tiny", "float32", None, None, None, None, None, 6, 1, methods, (), 1.0, 0, 16, "fixed", 4, {},
        "prompt", 0.8, None, False,
    )  # fmt: skip
    runner = Recording(tiny_model("qwen2"), tiny_tokenizer(), settings, LookaheadConfig(), prompts)
    measured = measure(runner, methods)
    timed = calls[len(methods) :]  # after the warm-up
    first = [method for n, (_, method) in enumerate(timed) if n % len(methods) == 0]
    assert sorted(first) == sorted(methods)  # each method led one prompt
    assert all(list(row)[-3:] == list(methods) for row in measured.per_prompt)
    assert all(row[m]["identical_to_greedy"] for row in measured.per_prompt for m in methods[1:])


def test_batch_bench_turns_its_methods_between_levels_and_lists_them_in_the_order_asked():
    from rag_lookahead.bench.batch import Workload, measure

    tokenizer = tiny_tokenizer()
    requests = [tokenizer.encode(f"t5 t6 t7 t{9 + i} t5 t6", add_special_tokens=False) for i in range(3)]
    ran: list[tuple[int, str]] = []

    class Recording(Workload):
        def run(self, method, level):
            ran.append((level, method))
            return super().run(method, level)

    work = Recording(tiny_model("llama"), [3], 0, requests, LookaheadConfig(), {}, 5)
    methods = ["hf_greedy", "plain", "lookahead"]
    results, _ = measure(work, methods, [1, 2, 3], 1)
    assert [m for level, m in ran if level == 1][0] != [m for level, m in ran if level == 2][0]
    assert [r["method"] for r in results] == methods * 3
    assert [r["concurrency"] for r in results] == [1] * 3 + [2] * 3 + [3] * 3
    assert all(r["identical_to_single"] in (None, "3/3") for r in results)
