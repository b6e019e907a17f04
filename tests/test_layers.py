"""The package's layers point down: the import graph (every import, function-local ones too, resolved to absolute
module names) has no cycle between top-level parts, the models never reach up into checkpoints, settings,
calibration, measurement or the benchmarks, the measurements sit below calibration, settings and bench, and
train_draft reaches the CPU kernels only through the library's door, as any user would."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ddd_jax", "train_draft", "convert")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module (and `from m import x` as m.x) that `path` imports, anywhere in it."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            m = ".".join(base + ([node.module] if node.module else []))
            names.add(m)
            names.update(f"{m}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


GRAPH = {module_name(p): imports(p) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}

MODELS = ["ddd_jax.layers", "ddd_jax.llama", "ddd_jax.head_kinds", "ddd_jax.eagle", "ddd_jax.eagle1",
          "ddd_jax.eagle3", "ddd_jax.cache", "ddd_jax.tree", "ddd_jax.verify", "ddd_jax.target", "ddd_jax.modules",
          "ddd_jax.keytable", "ddd_jax.config", "ddd_jax.ops", "ddd_jax.sharding", "ddd_jax.decode.state",
          "ddd_jax.decode.drafting", "ddd_jax.decode.cycle", "ddd_jax.decode.drivers"]


def reaches(mod: str, parts: tuple[str, ...]) -> list[str]:
    return sorted(m for m in GRAPH[mod] if any(m == p or m.startswith(p + ".") for p in parts))


def test_the_graph_is_read():  # the rules below would pass on an empty graph
    assert set(MODELS) <= set(GRAPH) and "ddd_jax.keytable" in GRAPH["ddd_jax.eagle"] | GRAPH["ddd_jax.target"]
    assert "ddd_jax.measure.cost.cost_curve" in GRAPH["ddd_jax.calibration"]


@pytest.mark.parametrize("mod", MODELS)
def test_models_never_reach_up(mod):
    up = reaches(mod, ("ddd_jax.checkpoints", "ddd_jax.settings", "ddd_jax.calibration", "ddd_jax.measure",
                       "ddd_jax.bench", "ddd_jax.cli", "ddd_jax.decode.api"))
    assert not up, f"{mod} imports {up}"


def test_measurement_calibration_and_settings_sit_below_bench():
    for mod in [m for m in GRAPH if m.startswith(("ddd_jax.measure", "ddd_jax.settings"))] + ["ddd_jax.calibration"]:
        up = reaches(mod, ("ddd_jax.bench",) + (() if mod == "ddd_jax.calibration" else ("ddd_jax.calibration",)))
        assert not up, f"{mod} imports {up}"
    for mod in [m for m in GRAPH if m.startswith("ddd_jax.measure")]:
        assert not reaches(mod, ("ddd_jax.settings",)), f"{mod} imports the settings it measures for"


def test_train_draft_and_convert_use_the_library_as_a_user_would():
    for mod in [m for m in GRAPH if m.startswith(("train_draft", "convert"))]:
        bad = reaches(mod, ("ddd_jax.backends", "ddd_jax.cli"))
        assert not bad, f"{mod} imports {bad}"


def test_no_cycle_between_top_level_parts():
    """Parts: each module directly under ddd_jax (a subpackage is one part), train_draft, convert. The package's
    __init__ (the public API that gathers them) is left out."""
    def part(m: str) -> str | None:
        bits = m.split(".")
        if bits[0] != "ddd_jax":
            return bits[0] if bits[0] in PACKAGES else None
        return None if len(bits) == 1 else ".".join(bits[:2])

    parts = {part(m) for m in GRAPH} - {None}
    edges = {p: set() for p in parts}
    for mod, names in GRAPH.items():
        src = part(mod)
        if src is not None:
            edges[src] |= {part(m) for m in names} & parts - {src}
    done: set[str] = set()

    def visit(n: str, path: list[str]) -> None:  # depth first; a part already on the path closes a cycle
        for d in sorted(edges[n]):
            assert d not in path, "import cycle: " + " -> ".join(path[path.index(d):] + [n, d])
            if d not in done:
                visit(d, path + [n])
        done.add(n)

    for n in sorted(parts):
        if n not in done:
            visit(n, [])
    assert len(done) == len(parts) > 20
