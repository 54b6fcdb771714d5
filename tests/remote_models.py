"""Local model folders whose remote code (``remote_code/modeling_tiny_remote.py``) runs only with
``trust_remote_code``: a config.json whose ``auto_map`` points at classes in a modeling file next
to it, as ChatGLM3 and Qwen-1 ship them on the hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer

MODELING = Path(__file__).resolve().parent / "remote_code" / "modeling_tiny_remote.py"


def remote_folder(root: Path, model_class: str) -> Path:
    """A local model folder whose config maps AutoModelForCausalLM to ``model_class`` in its own modeling file."""
    folder = (
        root / f"tiny_remote_{model_class.lower()}"
    )  # fixed names: transformers' module cache does not grow per run
    tiny_model("qwen2").save_pretrained(folder)  # the shared cached weights; saving does not change them
    tiny_tokenizer().save_pretrained(folder)
    shutil.copy(MODELING, folder / MODELING.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=[model_class],
        auto_map={
            "AutoConfig": "modeling_tiny_remote.TinyRemoteConfig",
            "AutoModelForCausalLM": f"modeling_tiny_remote.{model_class}",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder
