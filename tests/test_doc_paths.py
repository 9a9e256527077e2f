"""Every repository file named in a docstring or a comment of our Python files exists.

A word that looks like a path of ours (it ends in .py, .md, .cpp, .h, .json, ...: ``helpers.py``
beside this file, ``zero/runtime/hooks.py``, ``native/file.h``) is looked up relative to the
file's own folder, each folder above it (its package roots) and the repository root; one found
in none of them is reported with its file and line, so that a module moved or renamed takes the
pointers to it along. Not paths of ours: URLs, system headers written ``<linux/fs.h>``, words
with a glob in them (``test_*.py``), and the names in ALLOWED, files that programs make or read
at run time and that the repository does not keep.
"""

import ast
import io
import os
import re
import tokenize

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("nvmeio", "swapper", "zero", "tests", "bench", "tools")

# name (or folder prefix ending in "/") -> why it is not a file of the repository
ALLOWED = {
    "ds_config.json": "the user's DeepSpeed config, in usage examples",
    "train.py": "the user's training script, in usage examples",
    "config.json": "a Hugging Face model's config, inside a checkpoint folder",
    "model.safetensors.index.json": "the shard index of a Hugging Face checkpoint",
    "pytorch_model.bin.index.json": "the shard index of a Hugging Face checkpoint",
    "zero_meta.json": "a file inside a checkpoint that the engine saves",
    "deepspeed/": "DeepSpeed's own sources (its installed package), where the facts of its checkpoints come from",
    "bench/out/": "benchmark results, written at run time (git-ignored)",
    "bench/reliability.json": "bench/reliability.py's results, written at run time",
    "gpu_check.json": "bench/gpu_check.py's results, written to its --out at run time",
    "gpu_check.md": "bench/gpu_check.py's report, written to its --out at run time",
    "liburing.h": "liburing's header: the system's, or the kit's that tools/gpu_kit.sh fetches",
}

_EXTENSIONS = "py|pyi|md|rst|txt|cpp|cc|c|h|hpp|cu|json|toml|cfg|ini|yaml|yml|sh|cmake"
# Folders and a file name, or a bare file name; not part of a longer word, a URL or a glob. A
# leading shell variable ($REPO/bench/io_bound.py, in a command run from elsewhere) stands for the root.
_PATH = re.compile(r"(?<![\w./:*<$-])(?:\$\{?\w+\}?/)?"
                   r"((?:\.{1,2}/)?(?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:" + _EXTENSIONS + r"))(?![\w/*>-])")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S*")


def texts(source: str):
    """(line, text) of every comment and docstring of a module's source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def named_paths(text: str):
    """(offset, word) of each word of ``text`` that looks like a path of ours."""
    text = _URL.sub(lambda m: " " * len(m.group()), text)  # same offsets, no URL
    for m in _PATH.finditer(text):
        word = m.group(1)
        if word in ALLOWED or any(word.startswith(p) for p in ALLOWED if p.endswith("/")):
            continue
        yield m.start(1), word


def resolves(word: str, folder: str, repo: str = REPO) -> bool:
    """``word`` names a file or folder relative to ``folder``, a folder above it, or ``repo``."""
    here = os.path.abspath(folder)
    repo = os.path.abspath(repo)
    while True:
        if os.path.exists(os.path.join(here, word)):
            return True
        if here == repo or os.path.dirname(here) == here:
            return False
        here = os.path.dirname(here)


def stale_paths(path: str, repo: str = REPO):
    """``file:line: word`` for each path named in ``path``'s comments and docstrings that is not there."""
    with open(path) as f:
        source = f.read()
    folder = os.path.dirname(path)
    for line, text in sorted(texts(source)):
        for offset, word in named_paths(text):
            if not resolves(word, folder, repo):
                yield f"{os.path.relpath(path, repo)}:{line + text.count(chr(10), 0, offset)}: {word}"


def python_files():
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "out"))
            yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def test_every_path_named_in_docstrings_and_comments_exists():
    files = list(python_files())
    assert len(files) > 100 and os.path.join(REPO, "zero", "engine", "build.py") in files
    stale = [s for path in files for s in stale_paths(path)]
    assert stale == [], "files named in comments or docstrings that do not exist (moved or renamed?):\n" + \
        "\n".join(stale)


# -- the matcher itself -------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("see zero/engine/build.py [Note: x]", ["zero/engine/build.py"]),
    ("the hooks (hooks.py, [Note: lending])", ["hooks.py"]),
    ("native/file.h and docs/architecture.md.", ["native/file.h", "docs/architecture.md"]),
    ("relative: ../zero/hf.py or ./setup.cfg", ["../zero/hf.py", "./setup.cfg"]),
    ("kept in DESIGN.md", ["DESIGN.md"]),
    ("https://github.com/rapidsai/kvikio/blob/main/cpp/src/defaults.cpp", []),
    ("constants of <linux/fs.h>", []),
    ("every tests/test_*.py file", []),
    ('zero.initialize(model=m, config="ds_config.json")', []),
    ("writes bench/out/scale.json", []),
    ("cd /tmp && python $REPO/bench/io_bound.py --out ${REPO}/bench/x.json", ["bench/io_bound.py", "bench/x.json"]),
    ("an absolute /usr/include/linux/fs.h is not ours", []),
    ("torch.save(f) to t.bin, x.pt; zero.hf.ZeroTrainer; e.g. 1.5", []),
])
def test_the_matcher_finds_paths_and_only_paths(text, words):
    assert [w for _, w in named_paths(text)] == words


def test_a_stale_path_is_reported_with_its_line_and_a_good_one_is_not(tmp_path):
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "real.py").write_text("")
    (pkg / "near.py").write_text("")
    module = pkg / "mod.py"
    module.write_text('"""Uses near.py, real.py, pkg/real.py\nand gone.py."""\n\n'
                      "x = 1  # see sub/near.py and old/flat.py\n")
    assert list(stale_paths(str(module), str(tmp_path))) == [
        f"{os.path.join('pkg', 'sub', 'mod.py')}:2: gone.py", f"{os.path.join('pkg', 'sub', 'mod.py')}:4: old/flat.py"]
