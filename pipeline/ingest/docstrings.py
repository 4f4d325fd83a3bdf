"""`builtin:python-docstrings`: instruction pairs from the standard library's own docstrings.

For each public, documented function, class and method of the standard library's top-level
modules (``json.py``, ``textwrap.py``, ...), a prompt asks for the docstring of
``module.name(signature)`` and the docstring is the completion. Sources are parsed with `ast`,
never imported (importing ``antigravity`` opens a browser), so the corpus is the same on every
machine with the same Python, and a few thousand pairs long.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

MIN_DOCSTRING = 20  # shorter ones ("Return x.") teach little
SYSTEM_PROMPT = "You write concise, accurate Python docstrings."


@dataclass(frozen=True)
class DocstringPair:
    name: str  # module.qualname, unique in the corpus
    prompt: str
    docstring: str


def module_files() -> list[tuple[str, str]]:
    """(module name, path) of the public top-level standard library modules, sorted."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(f for f in os.listdir(stdlib) if f.endswith(".py") and not f.startswith("_"))
    return [(f[:-3], os.path.join(stdlib, f)) for f in names if f[:-3] in sys.stdlib_module_names]


def pairs(module: str, source: bytes) -> Iterator[DocstringPair]:
    """The pairs of one module's source, in source order; a name defined twice counts once."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    seen: set[str] = set()
    for node, qualname in _definitions(tree):
        docstring = ast.get_docstring(node)
        name = f"{module}.{qualname}"
        if name in seen or docstring is None or len(docstring) < MIN_DOCSTRING:
            continue
        seen.add(name)
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        prompt = f"Write the docstring of the {kind} `{name}{_signature(node)}`."
        yield DocstringPair(name, prompt, docstring)


def _definitions(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    for node in tree.body:
        if not _public(node):
            continue
        yield node, node.name
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if _public(method) and not isinstance(method, ast.ClassDef):
                    yield method, f"{node.name}.{method.name}"


def _public(node: ast.AST) -> bool:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return isinstance(node, kinds) and not node.name.startswith("_")


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(base) for base in node.bases)
        return f"({bases})" if bases else ""
    return f"({ast.unparse(node.args)})"
