"""The package's shape, read from its source with ast: layers import only downward, no import
circle, no private name taken from another module, no module past the size a reader can hold.

Layers, bottom up (DESIGN.md section 4): core, kernels, cache, mlx_lm, eval, bench, cli.  A module
may import its own layer and the layers below; ``oiq_mlx/__init__.py`` (the public facade) may
import any of them, and no module imports the facade.  Lazy imports inside functions count too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "oiq_mlx"
LAYERS = ("core", "kernels", "cache", "mlx_lm", "eval", "bench", "cli")
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(mod: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_package else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict) -> list[tuple]:
    """``(importer, imported module, imported name or None, line)`` for every import of an
    oiq_mlx module, a name imported from one resolved to its module where it is a submodule."""
    out = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(mod, a.name, None, node.lineno) for a in node.names if a.name.startswith("oiq_mlx")]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                if not target.startswith("oiq_mlx"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    out.append((mod, sub, None, node.lineno) if sub in mods else (mod, target, a.name, node.lineno))
    return out


def layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_is_in_a_layer():
    stray = [m for m in modules() if m != "oiq_mlx" and layer(m) is None]
    assert stray == [], f"modules outside the layers {LAYERS}: {stray}"


def test_imports_go_down_the_layers_only():
    mods = modules()
    wrong = []
    for importer, target, _, line in imports(mods):
        if importer == "oiq_mlx":
            continue
        if target == "oiq_mlx":
            wrong.append(f"{importer}:{line} imports the package facade oiq_mlx")
        elif layer(target) > layer(importer):
            wrong.append(f"{importer}:{line} ({LAYERS[layer(importer)]}) imports {target} ({LAYERS[layer(target)]})")
    assert wrong == [], "upward imports:\n" + "\n".join(wrong)


def test_no_import_circle():
    mods = modules()
    graph = {m: set() for m in mods}
    for importer, target, _, _ in imports(mods):
        # importing a package runs its __init__; a module's own package is already running
        if target in mods and not importer.startswith(target + "."):
            graph[importer].add(target)
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "import circles:\n" + "\n".join(cycles)


def test_no_private_name_crosses_modules():
    mods = modules()
    crossing = []
    for importer, target, name, line in imports(mods):
        private = [p for p in target.split(".") + ([name] if name else []) if p.startswith("_") and not p.startswith("__")]
        if private:
            crossing.append(f"{importer}:{line} imports {target}{'.' + name if name else ''}")
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                for a in node.names:
                    if f"{target}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                crossing.append(f"{mod}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert crossing == [], "private names used across modules:\n" + "\n".join(crossing)


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_fits_a_reader(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it along its jobs"
