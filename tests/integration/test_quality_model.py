"""The embedded quality model (Qwen2.5-Coder-1.5B-Instruct, the ``rag-lookahead[quality]`` extra), for real.

Skipped with the reason when its 22 part packages are not installed and it was never converted.
The first run converts it into the cache (minutes on a CPU); later runs load the folder.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from rag_lookahead.decoding.config import LookaheadConfig
from rag_lookahead.decoding.loop import generate
from rag_lookahead.embedded_model import QUALITY, is_complete
from rag_lookahead.models import embedded_model_dir, load_model
from rag_lookahead.tokens import encode_messages

pytestmark = pytest.mark.slow


def _missing_parts() -> list[str]:
    missing = []
    for package in QUALITY.packages:
        try:
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
    return missing


@pytest.fixture(scope="module")
def quality_fp32():
    missing = _missing_parts()
    if missing and not is_complete(embedded_model_dir("quality", convert=False), QUALITY):
        pytest.skip(
            f"the quality model is not installed ({len(missing)} part packages missing): {QUALITY.install_command}"
        )
    return load_model("quality", dtype=torch.float32, device="cpu")


def test_quality_model_is_a_plain_converted_folder(quality_fp32):
    model, tokenizer = quality_fp32
    folder = embedded_model_dir("quality", convert=False)
    assert folder.name == QUALITY.folder_name and is_complete(folder, QUALITY)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == 28 and config["hidden_size"] == 1536  # the 1.5B, not the 0.5B
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_quality_lookahead_equals_greedy_generate_fp32(quality_fp32):
    # fp32 1.5B on a CPU: ~1 s a token, so few tokens and a small fixed draft (no cost-curve measurement)
    model, tokenizer = quality_fp32
    passage = (
        "`branch_length` is the maximum depth of the draft, which is the maximum number of tokens accepted"
        " in one step. The default is 24."
    )
    ids = encode_messages(tokenizer, [{"role": "user", "content": f"{passage}\n\nWhat is branch_length?"}])
    prompt = torch.tensor([ids])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    config = LookaheadConfig(budget="fixed", decoding_length=6, branch_length=6)
    result = generate(model, prompt, max_new_tokens=12, config=config)
    assert result.sequences[0].tolist() == expected[0].tolist()
    # the answer starts by quoting the passage: some step accepts more than one token
    assert result.stats.forward_passes < result.stats.new_tokens - 1
