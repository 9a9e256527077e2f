"""The layering holds: native -> nvmeio -> swapper -> zero, no upward import, and the
import circles that once tied aio_handle/backend_choice/cuda_staging and the config
models to each other stay broken (imports inside functions count too)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("nvmeio", "swapper", "zero")  # each may import only those before it
NATIVE = "nvmeio._native"


def _modules() -> dict:
    mods = {}
    for pkg in LAYERS:
        for folder, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), REPO)[:-3].replace(os.sep, ".")
                    mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = \
                        os.path.join(folder, f)
    return mods


def _imports(name: str, path: str, mods: dict) -> set:
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                full = f"{base}.{a.name}"
                # a submodule (NATIVE is compiled from native/: below every layer) or a name
                found.add(full if full in mods or full == NATIVE else base)
    return found


def _graph() -> dict:
    mods = _modules()
    return {m: {t for t in _imports(m, p, mods) if t in mods and t != m} for m, p in mods.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_package_imports_a_layer_above_it():
    upward = []
    for module, targets in _graph().items():
        rank = LAYERS.index(module.split(".")[0])
        upward += [(module, t) for t in targets if LAYERS.index(t.split(".")[0]) > rank]
    assert upward == []


def test_the_handle_and_config_modules_are_in_no_import_circle():
    watched = {"nvmeio.aio_handle", "nvmeio.backend_choice", "nvmeio.cuda_staging",
               "nvmeio.gds_handle", "nvmeio.settings", "zero.config.base", "zero.config.auto",
               "zero.config.ds_config", "zero.config.aio"}
    assert watched <= set(_graph())
    tangled = [c for c in _cycles(_graph()) if watched & set(c)]
    assert tangled == []
