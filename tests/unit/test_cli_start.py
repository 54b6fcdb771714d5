"""What a CLI start pays for: commands that need no LLM do not import transformers (~1 s here)."""

import subprocess
import sys


def test_the_cli_imports_without_transformers():
    code = "import sys, rag_lookahead.cli; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_tiny_model_still_builds_from_the_lazy_import():
    from rag_lookahead.tiny import build_tiny_model

    model = build_tiny_model("qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM"
