"""The package layout is the architecture: imports run one way, and no module grows without a reason.

    lab ─► node.loop/records/persistence/build/cli ─► swarm ─► learn        bootstrap ─► ops ─► learn
                                                └──► ops   ─► learn                  └─► p2p
                                                     swarm ─► p2p

A failure here names the file, the line and the import that runs against the arrows (docs/ARCHITECTURE.md).
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
    "bootstrap": {"root", "ops", "p2p"},
    "root": set(),
}
# the round loop, what it records, what it keeps on disk, what builds it, its CLI: node/ top
ROUND_MODULES = {"node.loop", "node.records", "node.persistence", "node.build", "node.cli"}
LONG_MODULE_LINES = 400
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
    return sub if sub in ("learn", "swarm", "ops", "lab") else "unknown"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import of one of our packages, relative ones resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from node import learn` names a subpackage: judge it as that subpackage
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names
                    if target in ("node",) and a.name in ("learn", "swarm", "ops", "lab", "loop", "cli")]
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


def test_long_modules_say_why():
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in our_sources()
            if (n := len(p.read_text().splitlines())) > LONG_MODULE_LINES
            and LONG_MODULE_REASON not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not long, f"over {LONG_MODULE_LINES} lines without '{LONG_MODULE_REASON}' in the docstring: {long}"
