"""The package's layers point down: the import graph (every import, function-local ones too, resolved to absolute
module names) has no cycle between top-level parts, the models never reach up into checkpoints, settings,
calibration, measurement or the benchmarks, the measurements sit below calibration, settings and bench,
train_draft reaches the CPU kernels only through the library's door, as any user would, and never the benchmarks,
its own modules import each other without a cycle, and a private name (`_x`) stays in its module."""
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


def assert_acyclic(edges: dict[str, set[str]]) -> None:
    """Fails naming the first import cycle of `edges` ({node: the nodes it imports})."""
    done: set[str] = set()

    def visit(n: str, path: list[str]) -> None:  # depth first; a node already on the path closes a cycle
        for d in sorted(edges[n]):
            assert d not in path + [n], "import cycle: " + " -> ".join((path + [n])[(path + [n]).index(d):] + [d])
            if d not in done:
                visit(d, path + [n])
        done.add(n)

    for n in sorted(edges):
        if n not in done:
            visit(n, [])


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
    assert_acyclic(edges)
    assert len(parts) > 20


def test_train_draft_never_reaches_into_the_benchmarks():
    """Head training measures with what `ddd_jax.measure` offers (prompts, acceptance), as the benchmarks do."""
    for mod in [m for m in GRAPH if m.startswith("train_draft")]:
        bad = reaches(mod, ("ddd_jax.bench",))
        assert not bad, f"{mod} imports {bad}"


def test_no_cycle_between_train_draft_modules():
    mods = sorted(m for m in GRAPH if m.startswith("train_draft."))
    assert len(mods) > 5
    assert_acyclic({m: {d for d in mods if d != m and reaches(m, (d,))} for m in mods})


def test_the_cycle_check_sees_a_cycle():
    with pytest.raises(AssertionError, match="a -> b -> a"):
        assert_acyclic({"a": {"b"}, "b": {"a"}})


def private_uses(mod: str, source: str, is_package: bool = False) -> set[tuple[str, str]]:
    """(module, name) of each private name (`_x`, not `__x__`) that module `mod` takes from another of our modules:
    by `from m import _x`, or as `m._x` where m names a module it imported. Private modules are not counted."""
    package = mod if is_package else mod.rpartition(".")[0]
    tree = ast.parse(source)
    aliases, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            m = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if f"{m}.{a.name}" in GRAPH:
                    aliases[a.asname or a.name] = f"{m}.{a.name}"
                elif a.name.startswith("_") and not a.name.startswith("__") and m != mod and m in GRAPH:
                    found.add((m, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in aliases:
                m = ".".join([aliases[v.id]] + chain[::-1])
                if m != mod and m in GRAPH:
                    found.add((m, node.attr))
    return found


# Private names still taken across modules: (importer, defining module, name). Each is for the defining module's
# owner to make public in a module both sides may import (or to keep where it is used). Do not add to it.
PRIVATE_CROSSINGS: set = set()  # none left: what two modules share is public in the one both import


def test_the_private_name_scan_reads_both_forms():
    source = ("from .train import _a, fit\nfrom . import recipe\nimport ddd_jax.bench.run as r\nimport ddd_jax\n"
              "from ._x import y\nrecipe._b(r._c, ddd_jax.llama._d, __name__)\n")
    assert private_uses("train_draft.cli", source) == {("train_draft.train", "_a"), ("train_draft.recipe", "_b"),
                                                       ("ddd_jax.bench.run", "_c"), ("ddd_jax.llama", "_d")}


def test_private_names_stay_in_their_module():
    found = {(module_name(p), m, name) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
             for m, name in private_uses(module_name(p), p.read_text(), p.name == "__init__.py")}
    new = sorted(found - PRIVATE_CROSSINGS)
    assert not new, "private names used outside their module (make them public where both may import them): " + \
        ", ".join(f"{imp} takes {m}.{name}" for imp, m, name in new)
    assert not [c for c in PRIVATE_CROSSINGS if c[0].startswith("train_draft")]
