"""The package's import graph, read from the source (nothing is imported):
no module imports itself back through others, no import runs up a layer, and
no module grows past 400 lines. Every import counts, a lazy one inside a
function too: a circle closed at run time is still a circle."""
import ast
import pathlib
from typing import Dict, List, Optional, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Source folder -> the package it installs as.
SOURCES = {ROOT / "pagedbackend": "pagedbackend"}

# Bottom up; a module may import its own layer and those below. "data" is
# every module directly under pagedbackend/ (config, params, errors: plain
# data) except the entry points, which sit on top.
ENTRY_POINTS = {"pagedbackend", "pagedbackend.serve", "pagedbackend.accounting"}
# The feature packages (spec_decode, structured) sit between the worker and
# the engine; their settings and request parameters are plain data that
# EngineConfig and SamplingParams carry, so those modules count as data.
FEATURE_DATA = {"pagedbackend.spec_decode.config", "pagedbackend.structured.params"}
LAYERS = ["data", "kernels", "core", "multimodal", "sample", "models", "quant", "lora", "worker", "structured", "spec_decode",
          "engine", "serving", "entry"]

# Imports that are not counted, each a compatibility name kept for importers
# outside the package; drop the entry when they move to the new name. None
# today: loadtest imports pagedbackend.quant and native_ops() directly.
COMPATIBILITY_REEXPORTS: Set[Tuple[str, str]] = set()

MAX_LINES = 400


def modules() -> Dict[str, pathlib.Path]:
    """Dotted name -> source file of every module of the package."""
    found = {}
    for folder, package in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported_modules(name: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """The package's modules that ``name`` imports (a name taken from a
    package counts as its submodule when there is one, else the package)."""
    is_package = path.name == "__init__.py"
    targets: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                          for alias in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in known:   # pagedbackend.quant.int8.Int8Linear -> the module
                target = target.rpartition(".")[0]
            if target and target != name and (name, target) not in COMPATIBILITY_REEXPORTS:
                targets.add(target)
    return targets


def import_graph() -> Dict[str, Set[str]]:
    found = modules()
    return {name: imported_modules(name, path, set(found)) for name, path in found.items()}


def layer_of(module: str) -> str:
    if module in ENTRY_POINTS:
        return "entry"
    if module in FEATURE_DATA:
        return "data"
    parts = module.split(".")
    if len(parts) == 2 and not (ROOT / "pagedbackend" / parts[1]).is_dir():
        return "data"
    return parts[1]


def find_circle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: Dict[str, int] = {}   # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            if circle:
                return circle
    return None


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    return sorted(f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)})"
                  for source, targets in graph.items() for target in targets
                  if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)))


def test_every_module_has_a_layer():
    assert {layer_of(name) for name in modules()} <= set(LAYERS)


def test_no_module_imports_itself_back_through_others():
    assert find_circle(import_graph()) is None


def test_no_import_runs_up_a_layer():
    assert upward_imports(import_graph()) == []


def test_the_checks_see_a_circle_and_an_upward_import():
    graph = {"pagedbackend.models.llama": {"pagedbackend.models.rotary"},
             "pagedbackend.models.rotary": {"pagedbackend.models.llama"}}
    assert find_circle(graph) == ["pagedbackend.models.llama", "pagedbackend.models.rotary",
                                  "pagedbackend.models.llama"]
    assert upward_imports({"pagedbackend.models.smooth": {"pagedbackend.engine.tokenizer"}}) == [
        "pagedbackend.models.smooth (models) imports pagedbackend.engine.tokenizer (engine)"]
    assert upward_imports({"pagedbackend.config": {"pagedbackend.models"}})   # data sits at the bottom


def test_no_module_is_over_400_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for path in modules().values()}
    over = {path for path, lines in lengths.items() if lines > MAX_LINES}
    assert not over, {path: lengths[path] for path in over}


def test_the_engine_module_keeps_the_step_alone_in_300_lines():
    # Input, output, sampling and speculation live beside the engine
    # (input_processor, output_processor, step_sampler, speculative).
    assert len((ROOT / "pagedbackend" / "engine" / "llm_engine.py").read_text().splitlines()) <= 300
