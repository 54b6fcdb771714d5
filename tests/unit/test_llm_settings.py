"""Settings of ``LookaheadLLM.from_model_id`` are checked before the model is loaded."""

from __future__ import annotations

import pytest

from rag_lookahead.errors import ConfigError
from rag_lookahead.langchain.llm import LookaheadLLM


def test_misspelt_setting_is_refused_before_the_load(tmp_path):
    """A misspelt setting (``temprature``) was refused by the constructor only after the load, which
    takes minutes for a large model: here the folder does not exist, so a load would fail first."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="invalid LookaheadLLM setting temprature.*nothing was loaded"):
        LookaheadLLM.from_model_id(str(missing), temprature=0.5)
    # a known setting passes the check and reaches the load, which names the folder
    with pytest.raises(Exception, match="no-such-model") as err:
        LookaheadLLM.from_model_id(str(missing), temperature=0.5)
    assert not isinstance(err.value, ConfigError) or "setting" not in str(err.value)
