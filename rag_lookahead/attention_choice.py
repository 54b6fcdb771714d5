"""Which ``attn_implementation`` a model load can take on this machine, checked before any file is read.

transformers refuses a misspelt name, or a flash attention whose package is not installed, only
inside ``from_pretrained``, as a ValueError or ImportError after the tokenizer and config were read:
``load_model`` took that for a broken model and told the user to delete a sound conversion of the
embedded model. Checked here first, it is a ConfigError that names the argument.
"""

from __future__ import annotations

import re
from typing import Any

from rag_lookahead.errors import ConfigError

__all__ = ["check_attn_implementation"]

#: the distributions transformers looks for (``FLASH_ATTENTION_COMPATIBILITY_MATRIX``' package checks)
_FLASH_PACKAGES = {2: "flash-attn", 3: "flash-attn-3", 4: "flash-attn-4"}


def check_attn_implementation(value: str | dict[str, Any] | None) -> None:
    """ConfigError unless transformers can take ``value``: None (the model's default), ``"eager"``, a
    registered implementation (``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``..., also with
    the ``"paged|"`` prefix), a hub kernel (``"org/name"``, which needs the ``kernels`` package), or a
    dict of these per sub-config. A flash attention also needs its package here, or ``kernels``, from
    which transformers takes a hub build instead."""
    for name in value.values() if isinstance(value, dict) else [value]:
        if name is not None:
            _check_one(name)


def _check_one(name: Any) -> None:
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import is_kernels_available

    if not isinstance(name, str):
        raise ConfigError(f"attn_implementation must be a string such as 'sdpa' or 'eager', got {name!r}")
    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    plain = name if name in known else name.removeprefix("paged|")  # transformers drops the old prefix
    if is_kernel(plain):
        if not is_kernels_available():
            raise ConfigError(
                f"attn_implementation {name!r} is a hub kernel, which needs the kernels package in a version"
                " this transformers supports (pip install kernels)"
            )
        return
    if plain not in known:
        raise ConfigError(
            f"unknown attn_implementation {name!r}; use one of {', '.join(known)} or a hub kernel (org/name)"
        )
    package = _missing_flash_package(plain)
    if package is not None:
        raise ConfigError(
            f"attn_implementation {name!r} needs the {package} package, which is not installed"
            f" (pip install {package}, on a machine with a CUDA GPU); leave it out for sdpa"
        )


def _missing_flash_package(name: str) -> str | None:
    """The package that ``flash_attention_N`` lacks here, else None: as transformers decides, where
    the ``kernels`` package (a hub build) or a device with its own flash attention (Ascend NPU, XPU)
    stands in for it. A package that is there but cannot run (no GPU) is left to transformers to say."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
    from transformers.utils import is_kernels_available

    match = re.fullmatch(r"flash_attention_(\d+)", name)
    spec = FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(int(match[1])) if match else None
    if spec is None or is_kernels_available():
        return None
    if any(available() for available, _ in spec.get("custom_supported_devices", ())):
        return None
    if spec["general_availability_check"]() or spec["pkg_availability_check"]():
        return None
    return _FLASH_PACKAGES.get(spec["flash_attn_version"], "flash-attn")
