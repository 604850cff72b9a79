"""Import structure and size of ``src/rhino``, read with ``ast`` (no module is imported: this runs in a second).

- No private name crosses a module boundary: no ``from .x import _y`` (module-level, function-local or in a
  parenthesised list) and no ``x._y`` on an imported rhino module; what is shared is public.
- Imports point down the pipeline (design.md): capture -> ir -> sharding -> cost -> search -> lower -> runtime,
  with ``ir`` the data model under all of them and ``memory`` (pure) beside them, used by search (the planned
  fit check), lower and runtime.
- The pure packages (ir, sharding, cost, search, memory) never import torch, not even inside a function.
  (``test_trainer.test_the_pure_packages_load_without_torch`` checks the same at import time.)
- Small functions and modules (design.md's house rules, issue #16): no function over 80 lines except the
  compiled branch-and-bound kernel (``memory/layout_bnb_core.run``, one numba function by design), no module
  over 800 lines.
- Graph semantics live in ``ir/analysis.py`` (issue #16): in the pure packages no ordering comparison with a
  ``boundary`` (the loss node's index: a name or attribute so called, or a local assigned from a ``.boundary``),
  no ``OpKind.VIEW`` outside ``ir/`` and no op-name regex (``re.compile`` of a pattern naming ``rand`` or
  ``dropout``) outside ``ir/``, except the functions listed in ``SEMANTICS_BY_DESIGN``.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rhino"
PURE = ("ir", "sharding", "cost", "search", "memory")
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 800
LONG_BY_DESIGN = {"rhino/memory/layout_bnb_core.py:run"}   # the numba kernel: one compiled loop
# file:function -> why it may still use what ``graph_semantics_outside_analysis`` looks for
SEMANTICS_BY_DESIGN = {
    # recomputation's cut positions: indices 0..boundary of a MemoryEstimate's forward (no graph at hand)
    "rhino/cost/remat.py:forward_cuts": "boundary",
    "rhino/cost/remat.py:segment_choices": "boundary",
    # op facts, not liveness: a view op's kernel time, and its linearity / sharding pass-through
    "rhino/cost/compute.py:op_time": "view",
    "rhino/search/space.py:_Info.__init__": "view",
    "rhino/sharding/propagate.py:Propagator.run": "view",
    "rhino/sharding/propagate.py:Propagator._options": "view",
}
# package -> the rhino packages and top-level modules it may import (besides itself)
# (``atomic``: file writes, a leaf module with no rhino imports, may be used by every package)
ALLOWED = {
    "ir": {"atomic"},
    "capture": {"ir", "atomic"},
    "sharding": {"ir", "atomic"},
    "cost": {"ir", "sharding", "atomic"},
    "search": {"ir", "sharding", "cost", "memory", "atomic"},   # rank_memory: the planned fit check (fit_memory)
    "memory": {"ir", "atomic"},
    "lower": {"ir", "capture", "sharding", "cost", "search", "memory", "atomic"},
    "runtime": {"ir", "capture", "sharding", "cost", "search", "memory", "lower", "check", "atomic"},
}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module under src/rhino (packages by their ``__init__``)."""
    out = {}
    for f in SRC.rglob("*.py"):
        parts = ("rhino",) + f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _base(module: str, file: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    here = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
    parts = here[:len(here) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(module: str, file: Path):
    """(line, imported absolute name, names taken from it) for every import statement, at any depth."""
    tree = ast.parse(file.read_text(), str(file))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, _base(module, file, node), [a.name for a in node.names], node
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, [], node


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def cross_module_private_imports() -> list[str]:
    bad = []
    for module, file in sorted(MODULES.items()):
        rel = file.relative_to(SRC.parent)
        bound: dict[str, str] = {}   # local name -> the rhino module it names
        for line, base, names, node in _imports(module, file):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif _private(a.name) and base != module:
                        bad.append(f"{rel}:{line}: from {base} import {a.name}")
            else:
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        bound[a.asname] = a.name
        for node in ast.walk(ast.parse(file.read_text())):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and bound[node.value.id] != module):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return bad


def upward_imports() -> list[str]:
    bad = []
    for module, file in sorted(MODULES.items()):
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in ALLOWED:
            continue   # top-level modules (api, check, cli, ...) may import anything
        me = parts[1]
        for line, base, names, _ in _imports(module, file):
            bparts = base.split(".")
            if bparts[0] != "rhino":
                continue
            targets = [bparts[1]] if len(bparts) > 1 else names   # ``from .. import x`` names packages
            for t in targets:
                if t != me and t not in ALLOWED[me]:
                    bad.append(f"{file.relative_to(SRC.parent)}:{line}: {me} imports {t}")
    return bad


def torch_in_pure_packages() -> list[str]:
    bad = []
    for module, file in sorted(MODULES.items()):
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in PURE:
            continue
        for line, base, _, _ in _imports(module, file):
            if base.split(".")[0] == "torch":
                bad.append(f"{file.relative_to(SRC.parent)}:{line}: imports {base}")
    return bad


def long_functions() -> list[str]:
    bad = []
    for module, file in sorted(MODULES.items()):
        rel = file.relative_to(SRC.parent)
        lines = file.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            bad.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_BY_DESIGN:
                    bad.append(f"{rel}:{node.lineno}: {node.name} has {n} lines")
    return bad


_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)


def _scopes(tree: ast.AST, prefix: str = ""):
    """(qualified name, function node) for every function, methods as ``Class.name``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _scopes(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _scopes(node, prefix + node.name + ".")


def _semantic_uses(scope: ast.AST, ir: bool):
    """(line, kind, text) for each use ``graph_semantics_outside_analysis`` looks for directly in ``scope``
    (nested functions are scopes of their own)."""
    body = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body.append(node)
            todo.extend(ast.iter_child_nodes(node))
    named = {"boundary"} | {t.id for n in body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute)
                            and n.value.attr == "boundary" for t in n.targets if isinstance(t, ast.Name)}
    for n in body:
        if isinstance(n, ast.Compare) and any(isinstance(op, _ORDER) for op in n.ops):
            for x in [n.left, *n.comparators]:
                name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None
                if name in named:
                    yield n.lineno, "boundary", f"compares {name}"
        elif not ir and isinstance(n, ast.Attribute) and n.attr == "VIEW" and isinstance(n.value, ast.Name) \
                and n.value.id == "OpKind":
            yield n.lineno, "view", "OpKind.VIEW"
        elif not ir and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "compile" \
                and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str) \
                and any(w in n.args[0].value for w in ("rand", "dropout")):
            yield n.lineno, "regex", "op-name regex"


def graph_semantics_outside_analysis() -> list[str]:
    bad = []
    for module, file in sorted(MODULES.items()):
        parts = module.split(".")
        rel = str(file.relative_to(SRC.parent))
        if len(parts) < 2 or parts[1] not in PURE or rel == "rhino/ir/analysis.py":
            continue
        tree = ast.parse(file.read_text())
        for qual, scope in [("<module>", tree), *_scopes(tree)]:
            for line, kind, text in _semantic_uses(scope, parts[1] == "ir"):
                if SEMANTICS_BY_DESIGN.get(f"{rel}:{qual}") != kind:
                    bad.append(f"{rel}:{line}: {qual} {text}")
    return sorted(bad, key=lambda b: (b.split(':')[0], int(b.split(':')[1]), b))


def test_no_private_name_crosses_a_module():
    assert cross_module_private_imports() == []


def test_imports_point_down_the_pipeline():
    assert upward_imports() == []


def test_pure_packages_never_import_torch():
    assert torch_in_pure_packages() == []


def test_no_function_over_80_lines_and_no_module_over_800():
    assert long_functions() == []


def test_graph_semantics_only_in_ir_analysis():
    assert graph_semantics_outside_analysis() == []


def _write(tmp_path: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = tmp_path / "rhino" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_the_scans_catch_each_kind_of_violation(tmp_path, monkeypatch):
    """The scans find what they look for (on a small fake package), so the empty lists above mean something."""
    _write(tmp_path, {
        "__init__.py": "", "lower/__init__.py": "", "runtime/__init__.py": "", "runtime/coll.py": "",
        "lower/a.py": "def _h():\n    pass\n",
        "lower/b.py": ("from .a import (x,\n    _h)\n"
                       "def f():\n    from ..runtime.coll import y\n    from . import a\n    return a._h\n"),
        "cost/__init__.py": "", "cost/c.py": "def g():\n    import torch.nn\n",
        "memory/__init__.py": "", "memory/m.py": "from ..runtime import coll\n",
        "search/__init__.py": "", "search/s.py": "def big():\n" + "    x = 1\n" * 80,
        "search/fwd.py": ("import re\nfrom ..ir.registry import OpKind\n_R = re.compile(r'(^|\\.)dropout')\n"
                          "class K:\n    def f(self, a, i):\n        b = a.boundary\n        return i <= b, a.boundary < 0\n"
                          "def g(node, boundary, kind):\n    x = [i for i in node if i > boundary]\n"
                          "    return x, kind is OpKind.VIEW, 3 in boundary\n"),
        "ir/__init__.py": "", "ir/analysis.py": "def f(boundary):\n    return boundary < 0\n",
        "ir/registry.py": "import re\n_R = re.compile('rand')\ndef v(k, boundary):\n    return k is OpKind.VIEW, 0 > boundary\n",
    })
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "SRC", tmp_path / "rhino")
    monkeypatch.setattr(here, "MODULES", _modules())
    private = cross_module_private_imports()
    assert [p.split(": ", 1)[1] for p in private] == ["from rhino.lower.a import _h", "a._h (rhino.lower.a)"]
    assert sorted(p.split(": ", 1)[1] for p in upward_imports()) == ["lower imports runtime", "memory imports runtime"]
    assert [p.split(": ", 1)[1] for p in torch_in_pure_packages()] == ["imports torch.nn"]
    assert long_functions() == ["rhino/search/s.py:1: big has 81 lines"]
    assert graph_semantics_outside_analysis() == [
        "rhino/ir/registry.py:4: v compares boundary",
        "rhino/search/fwd.py:3: <module> op-name regex",
        "rhino/search/fwd.py:7: K.f compares b", "rhino/search/fwd.py:7: K.f compares boundary",
        "rhino/search/fwd.py:9: g compares boundary", "rhino/search/fwd.py:10: g OpKind.VIEW"]
