"""What a type checker sees of ``rag_lookahead``: the package is marked typed (PEP 561), and every
public name is imported under ``TYPE_CHECKING``, since at run time most come from the lazy module
``__getattr__``, which a checker reads as ``Any`` (mypy passed any call to ``load_model``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import typing
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


def _type_checking_init(cls: type) -> ast.FunctionDef:
    """The ``__init__`` a class declares for type checkers only (``if TYPE_CHECKING:`` in its body)."""
    source = Path(inspect.getsourcefile(cls) or "").read_text(encoding="utf-8")
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    inits = [
        f
        for block in node.body
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for f in block.body
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
    ]
    assert len(inits) == 1, f"{cls.__name__} declares no __init__ for type checkers"
    return inits[0]


def test_type_checkers_see_the_config_fields_taking_numpy_integers():
    """``LookaheadConfig(decoding_length=np.int64(32))`` runs (``validate`` stores an int), but the
    generated ``__init__`` reads the fields' ``int`` to a type checker: mypy --strict refused it. The
    ``__init__`` declared for type checkers must name the fields the dataclass has, in its order,
    with its defaults, so that it cannot drift from the real one."""
    from rag_lookahead.decoding.config import LookaheadConfig

    declared = _type_checking_init(LookaheadConfig).args
    names = [a.arg for a in declared.args[1:]]
    defaults = [ast.unparse(d) for d in declared.defaults]
    real = inspect.signature(LookaheadConfig).parameters.values()
    assert names == [p.name for p in real]
    fields = {f.name: f for f in dataclasses.fields(LookaheadConfig)}
    assert defaults == [
        repr(f.default if f.default is not dataclasses.MISSING else f.default_factory()) for f in fields.values()
    ]
    integer_fields = [name for name, f in fields.items() if f.type == "int"]
    assert integer_fields and all(
        ast.unparse(a.annotation) == "Integer" for a in declared.args if a.arg in integer_fields
    )
    assert not declared.kwonlyargs and declared.vararg is None and declared.kwarg is None


def test_build_index_reports_unless_if_missing():
    """``build_index`` returns None only with ``if_missing=True``; typed ``IndexReport | None`` for
    every call, ``build_index(...).summary()`` was an error to mypy --strict. Its overloads take the
    implementation's parameters and tell the two returns apart."""
    from rag_lookahead.rag.build import build_index

    overloads = typing.get_overloads(build_index)
    real = inspect.signature(build_index)
    assert [str(inspect.signature(o).return_annotation) for o in overloads] == ["IndexReport", "IndexReport | None"]
    for overload in overloads:
        parameters = inspect.signature(overload).parameters
        assert [(p.name, p.kind) for p in parameters.values()] == [(p.name, p.kind) for p in real.parameters.values()]
    assert [str(inspect.signature(o).parameters["if_missing"].annotation) for o in overloads] == [
        "Literal[False]",
        "bool",
    ]


def test_no_module_getattr_is_seen_by_type_checkers():
    """A module-level ``__getattr__`` that a checker sees makes every name it cannot find ``Any``:
    mypy passed ``from rag_lookahead import load_modle`` and ``rag_lookahead.serve.nothing_here()``.
    The lazy ``__getattr__`` is defined under ``if not TYPE_CHECKING:``; the real names are imported
    under ``TYPE_CHECKING``."""
    lazy, seen = [], []
    for path in sorted(INIT.parent.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            hidden = (
                isinstance(node, ast.If)
                and isinstance(node.test, ast.UnaryOp)
                and isinstance(node.test.op, ast.Not)
                and isinstance(node.test.operand, ast.Name)
                and node.test.operand.id == "TYPE_CHECKING"
            )
            for inner in node.body if hidden else [node]:
                if isinstance(inner, ast.FunctionDef) and inner.name == "__getattr__":
                    (lazy if hidden else seen).append(path.relative_to(INIT.parent).as_posix())
    assert seen == []
    assert lazy == ["__init__.py", "serve/__init__.py"]
