"""What a type checker sees of ``rag_lookahead``: the package is marked typed (PEP 561), and every
public name is imported under ``TYPE_CHECKING``, since at run time most come from the lazy module
``__getattr__``, which a checker reads as ``Any`` (mypy passed any call to ``load_model``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import rag_lookahead

INIT = Path(rag_lookahead.__file__)


def _imports(body: list[ast.stmt]) -> dict[str, str]:
    """``{name: module}`` of the ``from module import name`` statements directly in ``body``."""
    return {
        alias.asname or alias.name: node.module
        for node in body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    blocks = [
        node.body
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "rag_lookahead/__init__.py has no (or more than one) `if TYPE_CHECKING:` block"
    return _imports(blocks[0])


def test_the_package_is_marked_typed():
    assert INIT.with_name("py.typed").is_file()


def test_every_public_name_is_imported_for_type_checkers():
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    eager = {name for name, module in _imports(tree.body).items() if module.startswith("rag_lookahead")}
    lazy = _type_checking_imports(tree)
    assert set(rag_lookahead.__all__) == eager | set(lazy)
    assert not eager & set(lazy)


def test_type_checkers_see_the_objects_the_package_hands_out():
    """The lists cannot drift either way: each name under TYPE_CHECKING is what ``__getattr__`` returns."""
    lazy = _type_checking_imports(ast.parse(INIT.read_text(encoding="utf-8")))
    for name, module in lazy.items():
        assert getattr(rag_lookahead, name) is getattr(importlib.import_module(module), name), name
    assert "TYPE_CHECKING" not in dir(rag_lookahead)
