"""Test modules share helpers through helper modules (tests/*.py that are not
test_*.py) or conftest fixtures, never by importing one another: a test module
is read by pytest alone, and importing one runs its module-level setup twice."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def imports_of_test_modules(path: pathlib.Path):
    """The test modules (``test_*``) that ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [name for name in names if name.rpartition(".")[2].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    offenders = {str(path.relative_to(TESTS)): names for path in sorted(TESTS.rglob("test_*.py"))
                 if (names := imports_of_test_modules(path))}
    assert offenders == {}


def test_the_scan_sees_an_import_of_a_test_module(tmp_path):
    module = tmp_path / "test_probe.py"
    module.write_text("from test_kernels import make_batch\nimport tests.kernels.test_fused_moe\nimport paged_batch\n")
    assert imports_of_test_modules(module) == ["test_kernels", "tests.kernels.test_fused_moe"]
