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


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ValueError("\nreal reason"), "ValueError: real reason"),  # it printed "ValueError: "
        (ValueError("bad xref\nmore"), "ValueError: bad xref"),
        (ValueError(""), "ValueError"),
    ],
)
def test_a_pdf_reading_error_is_its_type_and_first_line_with_text(error, expected):
    from rag_lookahead.rag.pdf_text import _error

    assert _error(error) == expected
