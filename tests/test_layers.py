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
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zmqtransport"
WINGS = ("zmqtransport.serve", "zmqtransport.fetch")
# Above the wings: the facade and what is built on it (CLI, benchmark, lab children, the model).
TOP = ("zmqtransport.transport", "zmqtransport.cli", "zmqtransport.bench", "zmqtransport.sim",
       "zmqtransport.__main__", "zmqtransport")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every zmqtransport module ``path`` imports (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("zmqtransport"))
        elif isinstance(node, ast.ImportFrom):
            found.update(imported_from(path, node, alias) for alias in node.names)
    found = {module for module in found if module.startswith("zmqtransport")}
    found.discard(module_name(path))
    return found


def imported_from(path: Path, node: ast.ImportFrom, alias: ast.alias) -> str:
    """The module that ``from ... import alias`` in ``path`` imports, by its absolute name.

    `from pkg import mod` imports the module; `from mod import name`, the module.
    """
    base = node.module or ""
    if node.level:
        name = module_name(path)
        anchor = (name if path.name == "__init__.py" else name.rsplit(".", 1)[0]).split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    dotted = f"{base}.{alias.name}"
    return dotted if base.startswith("zmqtransport") and is_module(dotted) else base


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
        if not any(in_wing(source, wing) for wing in (*WINGS, *TOP[1:4])) and source not in TOP
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


# ----------------------------------------------------------------------------- serve/ and torch

SERVE = PACKAGE / "serve"
# The serve/ modules that import torch themselves, each with what it does with it at run time.
# Every other serve/ module reaches tensors only through these (or through device/ and codec/).
SERVE_TORCH_IMPORTERS = {
    "zmqtransport.serve.snapshot": "copies what running receives still need into host tensors (torch.empty, "
    "one copy engine per torch.device)",
}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` that run when the module is imported (not those of
    functions, nor those under ``if TYPE_CHECKING:``)."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            found += ([] if is_type_checking(node) else run_at_import(node.body)) + run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += run_at_import(block)
        elif isinstance(node, ast.ClassDef):
            found += run_at_import(node.body)
    return found


def imported_at_import(path: Path) -> list[tuple[str, str]]:
    """(module, name it binds) for each import ``path`` runs when it is imported."""
    found: list[tuple[str, str]] = []
    for node in run_at_import(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found += [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(imported_from(path, node, a), a.asname or a.name) for a in node.names]
    return found


def source_of(module: str) -> Path:
    where = PACKAGE.parent / Path(*module.split("."))
    return where / "__init__.py" if where.is_dir() else where.with_suffix(".py")


def loads_torch(module: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether importing ``module`` imports torch: itself, or through a zmqtransport module that does."""
    if module == "torch" or module.startswith("torch."):
        return True
    if not module.startswith("zmqtransport") or not is_module(module) or module in seen:
        return False
    return any(loads_torch(target, seen | {module}) for target, _ in imported_at_import(source_of(module)))


def names_used_at_run_time(tree: ast.Module) -> set[str]:
    """Names the module reads outside annotations and ``if TYPE_CHECKING:`` blocks
    (with ``from __future__ import annotations`` an annotation is never evaluated)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            skipped.add(id(node.annotation))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            skipped.add(id(node.returns))
        elif isinstance(node, ast.AnnAssign):
            skipped.add(id(node.annotation))
        elif isinstance(node, ast.If) and is_type_checking(node):
            skipped.update(id(statement) for statement in node.body)
    used: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
        pending.extend(ast.iter_child_nodes(node))
    # A package's face hands on the names it lists: that is its use of them.
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in statement.targets):
            used.update(e.value for e in ast.walk(statement.value) if isinstance(e, ast.Constant))
    return used


def test_only_the_listed_serve_modules_import_torch_and_they_use_it_at_run_time() -> None:
    importers = {}
    for path in SERVE.rglob("*.py"):
        bound = [name for module, name in imported_at_import(path) if module == "torch" or module.startswith("torch.")]
        if bound:
            importers[module_name(path)] = bound
    assert sorted(importers) == sorted(SERVE_TORCH_IMPORTERS), (
        f"serve/ modules that import torch: {sorted(importers)}; each is listed in SERVE_TORCH_IMPORTERS with its use"
    )
    unused = {
        module: names
        for module, names in importers.items()
        if not set(names) & names_used_at_run_time(ast.parse(source_of(module).read_text()))
    }
    assert not unused, f"these import torch only for annotations: put the import under `if TYPE_CHECKING:` {unused}"


def test_no_serve_module_imports_torch_through_another_just_for_a_type() -> None:
    """An import that brings torch in (a module that imports it, or one that imports such a module) is
    run only where one of the names it binds is used at run time; one needed for annotations alone goes
    under ``if TYPE_CHECKING:``, so the pure scheduler and its records do not pull torch in for a type."""
    offenders = []
    for path in SERVE.rglob("*.py"):
        used = names_used_at_run_time(ast.parse(path.read_text()))
        bound: dict[str, set[str]] = {}
        for module, name in imported_at_import(path):
            bound.setdefault(module, set()).add(name)
        offenders += [
            (module_name(path), module, sorted(names))
            for module, names in bound.items()
            if not names & used and loads_torch(module)
        ]
    assert not offenders, f"imported for annotations only, each bringing torch in: {sorted(offenders)}"


# ----------------------------------------------------------------------------- class size

MAX_CLASS_CODE_LINES = 240


def code_lines(source: str, node: ast.ClassDef) -> int:
    """Lines of ``node`` (its decorators too) that hold code: blanks, comments and docstrings aside."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert node.end_lineno is not None
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(inner):
            doc = inner.body[0]
            assert doc.end_lineno is not None
            docstrings.update(range(doc.lineno, doc.end_lineno + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(max(first, token.start[0]), min(node.end_lineno, token.end[0]) + 1))
    return len(lines - docstrings)


def test_no_class_of_either_wing_is_over_240_lines_of_code() -> None:
    """A class past 240 lines of code holds more than one role (the review's measure; both wings keep to it)."""
    sizes = {}
    for path in [*SERVE.rglob("*.py"), *(PACKAGE / "fetch").rglob("*.py")]:
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                sizes[f"{module_name(path)}.{node.name}"] = code_lines(source, node)
    over = {name: size for name, size in sizes.items() if size > MAX_CLASS_CODE_LINES}
    assert not over, f"split these by role: {over}"


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
