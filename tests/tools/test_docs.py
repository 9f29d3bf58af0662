"""The documentation: the site builds with mkdocs in strict mode, and a broken
link, a missing anchor, a missing page or a page left out of the navigation
fails that build; the configuration reference is the page the source
generates; README.md stays a front door and BENCHMARKS.md a reference."""
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from pagedbackend.config import EngineConfig, SpeculativeConfig
from pagedbackend.serving.triton.settings import ModelSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import config_reference  # noqa: E402

README_MAX_LINES = 250
BENCHMARKS_MAX_LINES = 1000


def build_site(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the checkout at ``root``; output in ``.stdout``."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)


def test_the_docs_site_builds_in_strict_mode(tmp_path):
    result = build_site(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout
    for page in ("index", "openai", "triton", "sampling", "speculative", "quantization", "configuration",
                 "metrics", "deployment", "robustness", "tensor_parallel", "architecture", "BENCHMARKS",
                 "README"):
        assert (tmp_path / "site" / ("" if page == "index" else page) / "index.html").is_file(), page
    assert "Two commands" in (tmp_path / "site" / "README" / "index.html").read_text()
    assert "Two commands" not in (tmp_path / "site" / "index.html").read_text()


@pytest.fixture
def checkout_copy(tmp_path) -> pathlib.Path:
    """What the docs build reads, copied, so a test can break it."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mkdocs.yml", "README.md", "BENCHMARKS.md", "pagedbackend/config.py", "pagedbackend/spec_decode/config.py",
                 "pagedbackend/serving/triton/settings.py"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    return copy


BREAKAGES = {
    "a link to a page that does not exist": ("docs", "[gone](no-such-page.md)", "no-such-page.md"),
    "a link to a missing anchor": ("docs", "[gone](configuration.md#no-such-setting)", "no-such-setting"),
    "a README link to a missing benchmark": ("readme", "[gone](BENCHMARKS.md#no-such-benchmark)",
                                             "no-such-benchmark"),
    "a link to a source file that does not exist": ("docs", "[gone](../pagedbackend/no_such_module.py)",
                                                    "no_such_module.py"),
    "a navigation entry without a page": ("nav", "      - Gone: no-such-nav-page.md", "no-such-nav-page.md"),
    "a page left out of the navigation": ("page", "# An orphan\n", "orphan.md"),
}


def test_a_broken_link_or_a_missing_page_fails_the_build(checkout_copy, tmp_path):
    # Every breakage at once, in one build (each one warns, and strict mode
    # fails on any warning); the output names each of them.
    for breakage, (where, text, named) in BREAKAGES.items():
        if where == "docs":
            with open(checkout_copy / "docs" / "index.md", "a") as page:
                page.write(f"\n{text}\n")
        elif where == "readme":
            with open(checkout_copy / "README.md", "a") as page:
                page.write(f"\n{text}\n")
        elif where == "nav":
            config = checkout_copy / "mkdocs.yml"
            config.write_text(config.read_text().replace("      - Benchmarks: BENCHMARKS.md\n",
                                                         f"      - Benchmarks: BENCHMARKS.md\n{text}\n"))
        else:
            (checkout_copy / "docs" / "orphan.md").write_text(text)
    result = build_site(checkout_copy, tmp_path / "site")
    assert result.returncode != 0, f"the build passed:\n{result.stdout}"
    assert f"Aborted with {len(BREAKAGES)} warnings" in result.stdout, result.stdout
    for breakage, (_, _, named) in BREAKAGES.items():
        assert named in result.stdout, (breakage, result.stdout)


def test_the_copied_checkout_builds_before_it_is_broken(checkout_copy, tmp_path):
    result = build_site(checkout_copy, tmp_path / "site")
    assert result.returncode == 0, result.stdout


def test_the_configuration_reference_is_the_page_the_source_generates():
    page = (ROOT / "docs" / config_reference.PAGE).read_text()
    assert page == config_reference.render(), (
        "docs/configuration.md differs from the settings' comments: "
        "run .venv/bin/python docs/hooks/config_reference.py --write")


@pytest.mark.parametrize("cls, name", [(EngineConfig, "{}"), (SpeculativeConfig, "speculative_config.{}"),
                                       (ModelSettings, "{}")])
def test_every_setting_has_a_documented_entry_in_the_reference(cls, name):
    page = (ROOT / "docs" / config_reference.PAGE).read_text()
    for field in dataclasses.fields(cls):
        label = name.format(field.name)
        label = label.upper() if cls is ModelSettings else label
        entry = re.search(rf"^### `{re.escape(label)}`\n\n(.+)\n\n(.+)$", page, re.M)
        assert entry, f"{cls.__name__}.{field.name} has no entry in docs/configuration.md"
        assert len(entry.group(2)) > 10, f"{cls.__name__}.{field.name}: no description"


def test_a_setting_without_a_comment_cannot_be_documented(tmp_path):
    source = tmp_path / "settings.py"
    source.write_text("class Example:\n    # What it is.\n    documented: int = 1\n"
                      "    inline: int = 2  # What this one is.\n    bare: int = 3\n")
    with pytest.raises(ValueError, match="Example.bare has no comment"):
        config_reference.class_fields(source, "Example")
    source.write_text(source.read_text().replace("    bare: int = 3\n", ""))
    assert [(f.name, f.doc) for f in config_reference.class_fields(source, "Example")] == [
        ("documented", "What it is."), ("inline", "What this one is.")]


def nav_pages() -> list:
    return re.findall(r"^\s+- [^:\n]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_readme_is_a_front_door_that_reaches_every_page_in_one_link():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make serve" in readme and "make test" in readme
    links = set(re.findall(r"\]\(([^)#\s]+)", readme))
    for page in nav_pages():
        target = page if page == "BENCHMARKS.md" else f"docs/{page}"
        assert target in links, f"README.md does not link {target}"


def test_benchmarks_md_is_a_reference_of_at_most_1000_lines():
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= BENCHMARKS_MAX_LINES


def test_benchmarks_are_cited_by_name_not_by_section_number():
    numbered = re.compile(r"BENCHMARKS(\.md)?\W{0,3}sections?\s+\d", re.I)
    offenders = []
    for folder in ("pagedbackend", "model_repository", "loadtest", "client", "docs", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".c", ".cpp", ".pbtxt", ".md", ".txt"):
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if numbered.search(line):
                        offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_benchmarks_section_cited_by_name_exists():
    sections = set(re.findall(r"^## (\S+(?: step)?)", (ROOT / "BENCHMARKS.md").read_text(), re.M))
    cited = re.compile(r'BENCHMARKS(?:\.md)?[^"\n]{0,12}"([^"]+)"')
    missing = []
    for folder in ("pagedbackend", "model_repository", "loadtest", "client"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".c", ".cpp", ".pbtxt"):
                for name in cited.findall(path.read_text(errors="replace")):
                    if name not in sections:
                        missing.append(f"{path.relative_to(ROOT)}: {name!r}")
    assert not missing, f"cited, but BENCHMARKS.md has no such section: {missing}"
