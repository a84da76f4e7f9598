"""The package layout is the architecture: imports run one way, and no module grows without a reason.

    lab ─► node.loop/records/evaluation/persistence/build/cli ─► swarm ─► learn        bootstrap ─► ops ─► learn
                                                └──► ops   ─► learn                  └─► p2p
                                                     swarm ─► p2p

A failure here names the file, the line and the import that runs against the arrows (docs/ARCHITECTURE.md),
or the modules of an import circle, inside a part as well as between parts.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("node", "p2p", "bootstrap")

# Which parts each part may import (besides itself). "root" is node/__init__.py and node/lazy.py (the version,
# and the stand-ins that keep what a node never uses out of its start).
ALLOWED: dict[str, set[str]] = {
    "p2p": set(),
    "learn": {"root"},
    "swarm": {"root", "learn", "p2p"},
    "ops": {"root", "learn"},
    "round": {"root", "learn", "swarm", "ops", "p2p"},
    "lab": {"root", "learn", "swarm", "ops", "p2p", "round"},
    "tools": {"root", "learn", "ops"},  # sapo-export, sapo-ask: a trained model outside any round
    "bootstrap": {"root", "ops", "p2p"},
    "root": set(),
}
# the round loop, what it records, its evaluations, what it keeps on disk, what builds it, its CLI: node/ top
ROUND_MODULES = {"node.loop", "node.records", "node.evaluation", "node.persistence", "node.build", "node.cli"}
# Counted in statements, not lines: the formatter may spread one call over several lines, and what a reader
# must hold in mind is the statements (the largest module without a reason had 277 when this was set)
LONG_MODULE_STATEMENTS = 300
LONG_MODULE_REASON = "Why this module is long:"


def part_of(module: str) -> str | None:
    """The architectural part a dotted module name belongs to, or None if it is not ours."""
    head, _, rest = module.partition(".")
    if head in ("p2p", "bootstrap"):
        return head
    if head != "node":
        return None
    if module in ("node", "node.lazy"):
        return "root"
    if module in ROUND_MODULES:
        return "round"
    sub = rest.split(".")[0]
    return sub if sub in ("learn", "swarm", "ops", "lab", "tools") else "unknown"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def import_statements(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, dotted module, names taken from it) for every import statement, relative ones resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import of one of our packages, relative ones resolved."""
    out = []
    for line, target, names in import_statements(path):
        out.append((line, target))
        # `from node import learn` names a subpackage: judge it as that subpackage
        out += [
            (line, f"{target}.{name}")
            for name in names
            if target in ("node",) and name in ("learn", "swarm", "ops", "lab", "loop", "cli")
        ]
    return [(line, m) for line, m in out if m.split(".")[0] in PACKAGES]


def test_every_module_belongs_to_a_known_part():
    unknown = [module_name(p) for p in our_sources() if part_of(module_name(p)) == "unknown"]
    assert not unknown, f"modules outside node/{{learn,swarm,ops,lab}} and {sorted(ROUND_MODULES)}: {unknown}"


def test_imports_run_one_way():
    violations = []
    for path in our_sources():
        src = part_of(module_name(path))
        for line, target in imports_of(path):
            dst = part_of(target)
            if dst in (src, None) or (target == "node" and src != "root"):
                continue
            if dst not in ALLOWED[src]:
                violations.append(f"{path.relative_to(REPO)}:{line}: {src} imports {target} ({dst})")
    assert not violations, "imports against the layout:\n" + "\n".join(violations)


def test_the_checker_sees_a_backwards_import(tmp_path, monkeypatch):
    """The walk itself must catch what it is for: p2p importing node, learn importing the lab."""
    fake = tmp_path / "node" / "learn"
    fake.mkdir(parents=True)
    bad = fake / "bad.py"
    bad.write_text("from node.lab.report import main\nfrom ..swarm import verify\nimport os\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    found = {t for _, t in imports_of(bad)}
    assert found == {"node.lab.report", "node.swarm"}
    assert {part_of(t) for t in found} - ALLOWED["learn"] == {"lab", "swarm"}


def module_edges(path: Path, known: set[str]) -> set[str]:
    """Our modules that the module at `path` imports, wherever the import stands.

    Lazy imports (inside a function) and `if TYPE_CHECKING:` imports count like module-level ones: they only
    hide a circle from the interpreter, the two modules still need each other (move the shared names into a
    module of their own, or turn the dependency around). `from pkg import sub` of a submodule is an edge to
    `pkg.sub`, not to `pkg`: a package's `__init__` runs before any of its submodules whatever they import,
    so a submodule naming its siblings through the package is no circle."""

    def longest_known(dotted: str) -> str | None:  # `a.b.name` of a function `name` in a.b: a.b
        parts = dotted.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        return ".".join(parts) or None

    edges: set[str | None] = set()
    for _, target, names in import_statements(path):
        submodules = {f"{target}.{name}" for name in names} & known
        edges |= submodules or {longest_known(target)}
        if submodules and len(submodules) < len(names):  # other names besides submodules come from the package
            edges.add(longest_known(target))
    return {e for e in edges if e is not None} - {module_name(path)}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph: every strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            circle = []
            while (w := stack.pop()) != v:
                circle.append(w)
            if circle:
                circles.append(sorted([v, *circle]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circles():
    sources = {module_name(p): p for p in our_sources()}
    known = set(sources)
    graph = {mod: module_edges(path, known) for mod, path in sources.items()}
    circles = import_circles(graph)
    assert not circles, "import circles (each a set of modules that import one another, lazily or not):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_checker_sees_an_import_circle(tmp_path, monkeypatch):
    """A lazy import closing a circle counts; a submodule importing a sibling through its package does not."""
    pkg = tmp_path / "p2p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p2p.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from p2p import a\n    return a\n")
    (pkg / "c.py").write_text("from p2p import a, b\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    known = {"p2p", "p2p.a", "p2p.b", "p2p.c"}
    graph = {m: module_edges(tmp_path / (m.replace(".", "/") + ".py"), known) for m in known - {"p2p"}}
    assert graph["p2p.c"] == {"p2p.a", "p2p.b"}
    assert import_circles(graph) == [["p2p.a", "p2p.b"]]


def statements(source: str) -> int:
    """How many statements a module holds, at any depth (a def, an assignment, a return: one each)."""
    return sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(source)))


def test_long_modules_say_why():
    long = [
        f"{p.relative_to(REPO)} ({n} statements)"
        for p in our_sources()
        if (n := statements(p.read_text())) > LONG_MODULE_STATEMENTS
        and LONG_MODULE_REASON not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    ]
    assert not long, f"over {LONG_MODULE_STATEMENTS} statements without '{LONG_MODULE_REASON}' in the docstring: {long}"


def test_statements_do_not_change_with_the_layout_of_lines():
    """The measure must not move when the formatter splits a call: the same code, two layouts, one count."""
    one_line = "def f(a, b):\n    return g(a, b, c=1)\n"
    spread = "def f(\n    a,\n    b,\n):\n    return g(\n        a,\n        b,\n        c=1,\n    )\n"
    assert statements(one_line) == statements(spread) == 2


def test_the_round_loop_class_stays_short():
    """SapoNode is read as the paper's algorithm: its bookkeeping lives in records, evaluation, persistence."""
    source = (REPO / "node" / "loop.py").read_text()
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "SapoNode"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= 220, f"SapoNode has {lines} lines (formatted): move bookkeeping out of the class"
