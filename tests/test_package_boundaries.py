"""The engine core imports no service: ``pagedserve/services/*`` are shells around ``pagedserve.engine``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CHECK = """
import pkgutil, importlib, sys
import pagedserve.engine, pagedserve.text
for package in (pagedserve.engine, pagedserve.text):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
import pagedserve.llm
print(sorted(m for m in ("pagedserve.services", "grpc", "redis") if m in sys.modules))
"""


def test_engine_text_and_llm_import_no_service_grpc_or_redis():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve",)


def _module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the packages except generated protobuf code."""
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "pb" in parts:
                continue
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The names an import statement imports: ``a.b`` for ``import a.b``; for ``from a import b``,
    ``a.b`` (a submodule or a name of ``a``) resolved against ``module`` when relative."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def parse(path: Path) -> ast.Module:
    """The file's syntax tree, parsed again when CPython 3.11 raised ``SystemError: AST constructor
    recursion depth mismatch``: its AST conversion keeps one counter per interpreter, which another
    thread's parse at the same moment upsets (python/cpython#106905; 3.11's traceback formatting
    parses, e.g. a server thread of an earlier test logging an error)."""
    for _ in range(2):
        try:
            return ast.parse(path.read_text())
        except SystemError:
            continue
    return ast.parse(path.read_text())


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports anywhere in its file (at the top, inside
    functions, under ``TYPE_CHECKING``): ``from a import b`` counts as importing ``a.b`` when that
    is a module, else ``a``."""
    files = _module_files()
    graph = {}
    for module, path in files.items():
        edges = set()
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.name == "__init__.py"):
                    target = name if name in files else name.rpartition(".")[0]
                    if target in files and target != module:
                        edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan, 1972), iteratively."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while not group or member != node:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                    if len(group) > 1:
                        found.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_cycle_finder_finds_a_cycle_through_a_deferred_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_packages_have_no_import_cycles_deferred_imports_included():
    graph = import_graph()
    assert "pagedserve.engine.weight_loader" in graph["pagedserve.engine.models.llama"]  # the graph is read
    assert [sorted(c) for c in cycles(graph)] == []


def test_no_module_imports_another_modules_private_name():
    """A name starting with ``_`` is its module's own: a module that needs it from another one
    shows a file split by line count rather than by meaning."""
    files = _module_files()
    private = []
    for module, path in files.items():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom) and node.module in files and node.module != module:
                private += [f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


TORCH_FREE = """
import sys
import pagedserve.engine.model_info, pagedserve.engine.models.registry
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_model_registry_and_model_info_import_without_torch():
    """The gateway reads model folders through the registry; it must not pay for torch."""
    out = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


GATEWAY_TORCH_FREE = """
import sys
import pagedserve.services.gateway.server
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer
tokenizer = PromptTokenizer.from_folder(sys.argv[1])
assert tokenizer.encode_chat([ChatTurn("user", "hi")])
print("torch" in sys.modules)
"""


def test_the_gateway_and_the_default_models_tokenizer_load_without_torch(default_model):
    """transformers' AutoTokenizer imports the model configuration code and torch (about 3 s of CPU
    in every gateway start); a folder whose tokenizer is a plain tokenizer.json is loaded without."""
    out = subprocess.run([sys.executable, "-c", GATEWAY_TORCH_FREE, str(default_model)], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"
