"""The package's layers, held against its imports (docs/architecture.md).

Two wings on shared ground: ``serve/`` (sending) and ``fetch/`` (receiving)
never import each other; nothing on the shared ground imports either wing or
the facade; no module imports itself back through a cycle; and no module
re-exports a name it does not define (package ``__init__`` files, whose job
that is, aside). The receiving wing has the sending wing's shape: its planner
and the pure books under it use no sockets and no threads, at most seven of
its modules import zmq, and none of its classes is over 240 lines of code.
Read from the source with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zmqtransport"
WINGS = ("zmqtransport.serve", "zmqtransport.fetch")
# Above the wings: the facade and what is built on it (CLI, benchmark, lab children).
TOP = ("zmqtransport.transport", "zmqtransport.cli", "zmqtransport.bench", "zmqtransport.__main__", "zmqtransport")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every zmqtransport module ``path`` imports (top level or inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("zmqtransport"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("zmqtransport"):
                continue
            # `from pkg import mod` imports the module; `from mod import name`, the module.
            found.update(f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names)
    found.discard(name)
    return found


def is_module(dotted: str) -> bool:
    where = PACKAGE.parent / Path(*dotted.split("."))
    return where.is_dir() or where.with_suffix(".py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def in_wing(module: str, wing: str) -> bool:
    return module == wing or module.startswith(wing + ".")


def test_the_wings_never_import_each_other() -> None:
    edges = graph()
    serve, fetch = WINGS
    crossing = [
        (source, target)
        for source, targets in edges.items()
        for target in targets
        if (in_wing(source, serve) and in_wing(target, fetch)) or (in_wing(source, fetch) and in_wing(target, serve))
    ]
    assert not crossing, crossing


def test_the_shared_ground_imports_neither_wing_nor_the_facade() -> None:
    edges = graph()
    upward = [
        (source, target)
        for source, targets in edges.items()
        if not any(in_wing(source, wing) for wing in (*WINGS, *TOP[1:3])) and source not in TOP
        for target in targets
        if any(in_wing(target, wing) for wing in WINGS) or target == "zmqtransport.transport"
    ]
    assert not upward, upward


def test_no_import_cycles() -> None:
    edges = graph()
    # Package __init__ files that only gather names would make every submodule
    # "import" its package; the cycle that matters runs between modules.
    packages = {m for m in edges if (PACKAGE.parent / Path(*m.split("."))).is_dir()}
    edges = {m: ts - packages for m, ts in edges.items() if m not in packages}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(target):], target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_no_module_re_exports_names_it_does_not_define() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {
            node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in tree.body:
            names = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in names):
                assert isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
                listed = {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}
                foreign = sorted(listed - defined)
                if foreign:
                    offenders.append((module_name(path), foreign))
    assert not offenders, offenders


def test_each_wing_logs_under_its_own_name() -> None:
    """One logger per wing, named after it: a user filters a side's lines with one name."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        wing = next((w for w in WINGS if in_wing(module_name(path), w)), None)
        if wing is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
                names = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
                if names != [wing]:
                    wrong.append((module_name(path), names or ast.unparse(node)))
    assert not wrong, wrong


# ----------------------------------------------------------------------------- the receiving wing's shape

FETCH = PACKAGE / "fetch"
# The receive's planner and the pure books and rules under it: no sockets, no threads (docs/architecture.md).
PURE_RECEIVE = ("planner", "spans", "peers", "verify", "registry", "requests", "liveness", "replies")


def outside_imports(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports from outside the package (``zmq``, ``threading``, ...)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def code_lines(node: ast.AST, lines: list[str]) -> int:
    """Lines of code of ``node``: blanks, comments and docstrings aside."""
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    assert isinstance(node, ast.stmt)
    span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
    code = [lines[n - 1].strip() for n in span if n not in docstrings]
    return sum(1 for line in code if line and not line.startswith("#"))


def test_the_receive_planner_and_its_books_use_no_sockets_and_no_threads() -> None:
    edges = graph()
    # What the planner reaches through the package's own imports, itself included.
    reached, todo = set(), ["zmqtransport.fetch.planner"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges.get(module, ()))
    assert {f"zmqtransport.fetch.{name}" for name in PURE_RECEIVE} <= reached
    offenders = []
    for module in sorted(reached):
        path = PACKAGE.parent / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if module in ("zmqtransport", "zmqtransport.fetch"):
            continue  # packages that gather names
        banned = outside_imports(path) & {"zmq", "threading", "socket", "selectors"}
        if banned:
            offenders.append((module, sorted(banned)))
    assert not offenders, offenders


def test_at_most_seven_modules_of_the_receiving_wing_import_zmq() -> None:
    using = sorted(path.stem for path in FETCH.glob("*.py") if "zmq" in outside_imports(path))
    assert len(using) <= 7, using


def test_no_class_of_the_receiving_wing_is_over_240_lines_of_code() -> None:
    long = []
    for path in FETCH.glob("*.py"):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (count := code_lines(node, lines)) > 240:
                long.append((f"{path.stem}.{node.name}", count))
    assert not long, long
