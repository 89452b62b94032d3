"""The package's shape: every import of eyas's own code points down the layers below, no
import circle, and pipeline stages meet only through artifacts (never each other's code).

Read from the source (AST, function-local imports included, `if TYPE_CHECKING:` blocks
skipped), so a lazy import cannot hide an edge. A new module must be placed in LAYERS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module may import modules of lower layers and of its own top-level package
# (eyas.draft.model -> eyas.draft.unroll); nothing of its own layer otherwise, nothing above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("failpoints", ("eyas.faults",)),  # where the fault-injection suite kills: reachable from every write
    ("files", ("eyas.io", "eyas.lock")),  # atomic writes, strict readers, one writer per dir: what the config reader and everything else use
    ("foundation", ("eyas", "eyas.host", "eyas.config", "eyas.packing", "eyas.fp8", "eyas.children",
                    "eyas.vllm_fixes")),
    ("records", ("eyas.manifest", "eyas.target", "eyas.vllm_runner")),
    ("rules", ("eyas.stage",)),  # where a stage writes, when it skips or resumes
    ("engines", ("eyas.models", "eyas.chat")),
    ("contracts", ("eyas.acceptance", "eyas.features", "eyas.draft")),
    ("checkpoints", ("eyas.checkpoints", "eyas.hybrid_serve")),  # hybrid_serve: a vLLM plugin over draft.hybrid
    ("stages", ("eyas.data", "eyas.quant", "eyas.synth", "eyas.extract", "eyas.train", "eyas.export",
                "eyas.evaluate")),
    ("loop", ("eyas.serve_eval", "eyas.report", "eyas.plan")),  # plan: what a run would do, read from its dir
    ("benchmarks", ("eyas.bench",)),
    ("pipeline", ("eyas.pipeline", "eyas.testing", "eyas.scale")),
    ("cli", ("eyas.cli",)),  # names every entry above as a "module:function" string, imported when run
    ("main", ("eyas.__main__",)),
]
# The one stage that runs another stage's code: online and streaming sources extract inside the trainer.
STAGE_EDGES = {("eyas.train", "eyas.extract")}


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The layered unit of a module: `eyas.X` (`eyas` itself for the package root)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_pkg: bool) -> set[str]:
    """Every `eyas...` module this file imports (resolved to the deepest existing module)."""
    out: set[str] = set()
    package = module if is_pkg else module.rsplit(".", 1)[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "eyas")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] == "eyas":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


FILES = {_module(p): p for p in sorted((SRC / "eyas").rglob("*.py"))}
MODULES = set(FILES)
GRAPH = {m: _imports(ast.parse(p.read_text()), m, p.name == "__init__.py") - {m} for m, p in FILES.items()}
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
STAGES = set(dict(LAYERS)["stages"])


def test_every_module_has_a_layer():
    missing = sorted({_unit(m) for m in MODULES} - set(LAYER_OF))
    assert not missing, f"place these in tests/test_architecture.py LAYERS: {missing}"


def test_imports_point_down():
    bad = []
    for m, targets in GRAPH.items():
        for t in targets:
            a, b = _unit(m), _unit(t)
            if a == b:
                continue
            if a in STAGES and b in STAGES:
                if (a, b) not in STAGE_EDGES:
                    bad.append(f"{m} -> {t} (stages meet through artifacts, not code)")
            elif LAYER_OF[b] >= LAYER_OF[a]:
                bad.append(f"{m} ({LAYERS[LAYER_OF[a]][0]}) -> {t} ({LAYERS[LAYER_OF[b]][0]})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(sorted(bad))


def _cycle() -> list[str] | None:
    """One import circle among eyas's modules, or None. A child importing names from its own
    package's __init__ (`from eyas.extract import Extractor` in eyas.extract.hf) is an edge to it."""
    edges = GRAPH
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := dfs(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(MODULES):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("bad", [
    ("eyas.export", "eyas.evaluate"),  # a stage importing a later one
    ("eyas.draft.model", "eyas.train.loop"),  # a contract importing a stage
])
def test_the_checks_see_a_violation(bad, monkeypatch):
    src, dst = bad
    monkeypatch.setitem(GRAPH, src, GRAPH[src] | {dst})
    with pytest.raises(AssertionError, match="imports that run up the layers"):
        test_imports_point_down()


def test_the_cycle_check_sees_a_circle(monkeypatch):
    monkeypatch.setitem(GRAPH, "eyas.draft.unroll", GRAPH["eyas.draft.unroll"] | {"eyas.draft.model"})
    assert _cycle() is not None
