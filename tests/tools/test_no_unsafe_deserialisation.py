"""Nothing that crosses a process or comes from a client is deserialised as
code: the product package (and the model repository's model.py) never calls
pickle, torch.load, marshal, numpy's pickled loads or multiprocessing's
object connections (docs/security.md). Read from the source; nothing imported."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "pagedbackend", ROOT / "kernels", ROOT / "model_repository"]
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                     "multiprocessing.connection"}
FORBIDDEN_CALLS = {"torch.load", "pickle.loads", "pickle.load", "np.load", "numpy.load",
                   "recv_pyobj", "send_pyobj", "broadcast_object_list", "all_gather_object",
                   "gather_object", "scatter_object_list", "recv_object_list", "send_object_list"}


def dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def findings(path: pathlib.Path) -> list:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in FORBIDDEN_CALLS or name.rsplit(".", 1)[-1] in FORBIDDEN_CALLS - {"load"}:
                found.append(name)
    return [f"{path.relative_to(ROOT)}: {f}" for f in found]


def test_no_module_deserialises_pickles():
    files = [p for folder in SOURCES for p in folder.rglob("*.py")]
    assert len(files) > 50
    assert [f for p in files for f in findings(p)] == []


def test_the_scan_finds_each_forbidden_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch\ntorch.load('x')\nsock.recv_pyobj()\n"
                   "from multiprocessing.connection import Client\n")
    names = sorted(f.rsplit(": ", 1)[1] for f in _findings_anywhere(bad))
    assert names == sorted(["pickle", "torch.load", "sock.recv_pyobj", "multiprocessing.connection"])


def _findings_anywhere(path):
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return findings(path)
    finally:
        ROOT = saved
