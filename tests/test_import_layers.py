"""The layering holds: native -> nvmeio -> swapper -> zero, no upward import; inside zero
the sub-areas import only those below them; no module of nvmeio, swapper or zero is in an
import circle (imports inside functions count too); no package exports a name equal
to one of its submodules (``import zero.initialize`` once made ``zero.initialize`` a module);
and a package imports of another only its public names: a name in that package's ``__all__``,
or in the ``__all__`` of a public module (no part of its name starts with an underscore),
which every public module of nvmeio and swapper has."""

import ast
import importlib
import os
import pkgutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("nvmeio", "swapper", "zero")  # each may import only those before it
NATIVE = "nvmeio._native"
# zero's sub-areas, bottom up; the package root (the public API) and its facades sit on top
ZERO_AREAS = ("config", "stores", "runtime", "partitioning", "checkpoint", "engine", "integrations")
ZERO_APPS = ("demo",)  # programs on the public API: they may import anything of zero


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


def test_no_module_is_in_an_import_circle():
    assert "zero.engine.entry" in _graph() and "nvmeio._fast_io" in _graph()
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _area(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "zero" and parts[1] in ZERO_AREAS else None


def test_zero_areas_import_only_the_areas_below_them():
    upward = []
    for module, targets in _graph().items():
        area = _area(module)
        if area is None:
            continue
        for t in targets:
            if t.startswith("zero") and (_area(t) is None or ZERO_AREAS.index(_area(t)) > ZERO_AREAS.index(area)):
                upward.append((module, t))
    assert upward == []


def test_zero_root_holds_only_the_public_api():
    root = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "zero")) if f.endswith(".py"))
    assert root == ["__init__", "examples", "hf", "lightning", "zero_to_fp32"]
    folders = sorted(d for d in os.listdir(os.path.join(REPO, "zero"))
                     if os.path.isfile(os.path.join(REPO, "zero", d, "__init__.py")))
    assert folders == sorted(ZERO_AREAS + ZERO_APPS)


def _packages():
    for top in LAYERS:
        package = importlib.import_module(top)
        yield package
        for info in pkgutil.walk_packages(package.__path__, f"{top}."):
            if info.ispkg:
                yield importlib.import_module(info.name)


@pytest.mark.parametrize("package", [p.__name__ for p in _packages()])
def test_no_exported_name_equals_a_submodule(package):
    package = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}
    exported = set(getattr(package, "__all__", ())) | {n for n in vars(package) if not n.startswith("_")
                                                     and not isinstance(vars(package)[n], type(os))}
    assert sorted(submodules & exported) == []


def test_zero_initialize_stays_the_function_after_every_submodule_is_imported():
    import zero

    for info in pkgutil.walk_packages(zero.__path__, "zero."):
        if not info.name.endswith("__main__") and not info.name.startswith(("zero.integrations.",)):
            importlib.import_module(info.name)
    for name in zero.__all__:
        assert not isinstance(getattr(zero, name), type(os)), name
    assert callable(zero.initialize) and zero.initialize.__module__ == "zero.engine.entry"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


@pytest.mark.parametrize("package", LAYERS)
def test_the_architecture_map_names_every_module_and_no_other(package):
    """docs/architecture.md's section of each package names its modules one to one (zero/ by folder)."""
    import re

    text = _section(open(os.path.join(REPO, "docs", "architecture.md")).read(), f"## {package}/")
    root = os.path.join(REPO, package)
    if package == "zero":
        blocks = re.split(r"\n\*\*(\w+)/\*\*", text)
        named = {"": set(re.findall(r"`(\w+)\.py`", blocks[0]))}
        named.update({blocks[i]: set(re.findall(r"`(\w+)\.py`", blocks[i + 1])) for i in range(1, len(blocks), 2)})
        folders = {"": root, **{d: os.path.join(root, d) for d in ZERO_AREAS + ZERO_APPS}}
    else:
        named, folders = {"": set(re.findall(r"`(\w+)\.py`", text))}, {"": root}
    for folder, path in folders.items():
        files = {f[:-3] for f in os.listdir(path) if f.endswith(".py") and f not in ("__init__.py", "__main__.py")}
        assert named.get(folder, set()) == files, folder or package


# -- public names across packages ----------------------------------------------------------------

def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split(".")[1:])


def _runtime_exports(module: str):
    """The ``__all__`` of ``module`` (imported), or None where it has none."""
    exported = getattr(importlib.import_module(module), "__all__", None)
    return None if exported is None else set(exported)


def _non_public_imports(module: str, tree: ast.AST, mods, exports=_runtime_exports) -> list:
    """What ``module`` (of the package its name starts with) imports from another package of
    LAYERS that is not public there: a module with a part starting with an underscore, a name
    outside the ``__all__`` of the module it comes from, or such an attribute of a package
    imported whole (``import nvmeio`` then ``nvmeio._handle``). ``mods``: the modules that exist;
    ``exports(name)``: a module's ``__all__`` (None: it has none)."""
    own = module.split(".")[0]
    found, whole = [], set()

    def foreign(target: str) -> bool:
        top = target.split(".")[0]
        return top != own and top in LAYERS

    def check_name(base: str, name: str) -> None:
        full = f"{base}.{name}"
        if full in mods:
            if name.startswith("_"):
                found.append(full)
        elif name not in (exports(base) or set()):
            found.append(full)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if foreign(a.name):
                    if not _is_public(a.name) or a.name not in mods:
                        found.append(a.name)
                    elif a.asname is None and "." not in a.name:
                        whole.add(a.name)
        elif isinstance(node, ast.ImportFrom) and not node.level and foreign(node.module):
            if not _is_public(node.module) or node.module not in mods:
                found.append(node.module)
                continue
            for a in node.names:
                check_name(node.module, a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in whole:
            check_name(node.value.id, node.attr)
    return sorted(set(found))


def test_packages_import_only_each_others_public_names():
    mods = _modules()
    found = {}
    for module, path in mods.items():
        bad = _non_public_imports(module, ast.parse(open(path).read()), mods)
        if bad:
            found[module] = bad
    assert found == {}


def test_the_public_name_checker_rejects_a_private_module_or_a_name_outside_all():
    mods = {"nvmeio": "", "nvmeio._handle": "", "nvmeio.settings": "", "swapper": "", "swapper._pool": ""}
    exports = {"nvmeio": {"aio_handle"}, "nvmeio.settings": {"AioSettings"}, "nvmeio._handle": {"aio_handle"},
               "swapper": {"PinnedBufferPool"}}.get

    def check(source: str, module: str = "zero.stores.x") -> list:
        return _non_public_imports(module, ast.parse(source), mods, exports)

    assert check("from nvmeio import aio_handle\nfrom nvmeio.settings import AioSettings\n"
                 "import nvmeio.settings\nfrom nvmeio import settings\nimport nvmeio\nnvmeio.aio_handle()\n"
                 "from swapper import PinnedBufferPool\nimport torch.nn\n") == []
    assert check("from nvmeio._handle import aio_handle") == ["nvmeio._handle"]
    assert check("from nvmeio import _handle") == ["nvmeio._handle"]
    assert check("import nvmeio._handle as h") == ["nvmeio._handle"]
    assert check("def f():\n    from nvmeio.settings import MAX_BLOCK_SIZE\n") == ["nvmeio.settings.MAX_BLOCK_SIZE"]
    assert check("from nvmeio import new_handle") == ["nvmeio.new_handle"]
    assert check("import nvmeio\nh = nvmeio._handle.aio_handle()") == ["nvmeio._handle"]
    assert check("from swapper._pool import SpanPool") == ["swapper._pool"]
    # its own package's private modules are a package's own business
    assert check("from nvmeio._handle import aio_handle", module="nvmeio.fast_io") == []
    assert check("from swapper._pool import SpanPool", module="swapper.x") == []


@pytest.mark.parametrize("package", ["nvmeio", "swapper"])
def test_every_public_module_says_what_it_exports(package):
    """A module without a leading underscore is public: it has an ``__all__``, every name of which exists."""
    public = [m for m in _modules() if m.split(".")[0] == package and _is_public(m) and not m.endswith("__main__")]
    assert f"{package}.settings" in public or f"{package}.checksum" in public
    for module in public:
        mod = importlib.import_module(module)
        assert isinstance(getattr(mod, "__all__", None), list), module
        assert [n for n in mod.__all__ if not hasattr(mod, n)] == [], module
