"""The one-line forms errors are printed in."""

from __future__ import annotations

import pytest

from rag_lookahead.errors import ConfigError, first_line


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ValueError("bad value\nTraceback detail"), "bad value"),
        (ValueError("\nreal reason\nmore"), "real reason"),  # printed an empty line before
        (RuntimeError("  \n\t padded reason  \n"), "padded reason"),
        (ConfigError(""), "ConfigError"),
        (OSError(" \n "), "OSError"),
    ],
)
def test_first_line_is_the_first_line_with_text_or_the_type(error, expected):
    assert first_line(error) == expected
