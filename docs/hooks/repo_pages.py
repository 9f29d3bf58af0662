"""mkdocs hook: README.md and BENCHMARKS.md, which live at the repository's
root, become pages of the site, and links are written once for GitHub and the
site alike.

Pages link as they would on GitHub: README.md to ``docs/openai.md``, a page
under docs/ to ``../BENCHMARKS.md#peers-beside-vllm-and-llamacpp``. Here such
links are pointed at the site's copies, so mkdocs checks every one of them,
anchors included (strict mode fails the build on a broken one). A link to any
other file of the repository (source code) must name a file that exists; on
the site it becomes plain text, since the site carries no source.

The configuration reference is regenerated from the source on every build
(``config_reference.py``), so the site never shows a stale one.
"""
import logging
import os
import posixpath
import re

from mkdocs.structure.files import File, InclusionLevel

import config_reference

log = logging.getLogger("mkdocs.hooks.repo_pages")

# Root files shown on the site, and whether the navigation lists them.
ROOT_PAGES = {"README.md": InclusionLevel.NOT_IN_NAV, "BENCHMARKS.md": InclusionLevel.UNDEFINED}
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)((?:\s+\"[^\"]*\")?)\)")
FENCE = re.compile(r"^(```|~~~)", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _repo_root(config) -> str:
    return os.path.dirname(config.config_file_path)


def on_files(files, config):
    """Add the root pages, read from the repository as they are."""
    root = _repo_root(config)
    for name, inclusion in ROOT_PAGES.items():
        page = File.generated(config, name, abs_src_path=os.path.join(root, name), inclusion=inclusion)
        # mkdocs takes any README.md for its folder's index; this one is a page of its own.
        page.name = posixpath.splitext(name)[0]
        page.dest_uri = f"{page.name}/index.html"
        files.append(page)
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == config_reference.PAGE:
        markdown = config_reference.render(_repo_root(config))
    root = _repo_root(config)
    docs = os.path.relpath(config.docs_dir, root).replace(os.sep, "/")
    # Where this page's source sits in the repository, and in the site's tree.
    in_repo = page.file.src_uri if page.file.src_uri in ROOT_PAGES else f"{docs}/{page.file.src_uri}"
    parts = FENCE.split(markdown)
    # Split on fences: even chunks are prose, odd ones a fence marker, and a
    # fence's body follows its opening marker until the next one.
    out, inside = [], False
    for i, chunk in enumerate(parts):
        if i % 2 == 1:
            inside = not inside
            out.append(chunk)
        elif inside:
            out.append(chunk)
        else:
            out.append(LINK.sub(lambda m: _rewrite(m, in_repo, page.file.src_uri, docs, root), chunk))
    return "".join(out)


def _rewrite(match, in_repo: str, src_uri: str, docs: str, root: str) -> str:
    bang, text, target, title = match.groups()
    if EXTERNAL.match(target) or target.startswith("#"):
        return match.group(0)
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(in_repo), path))
    if repo_path.startswith("../"):
        log.warning("%s: link %r leaves the repository", in_repo, target)
        return match.group(0)
    if repo_path in ROOT_PAGES:
        site_path = repo_path
    elif repo_path == docs or repo_path.startswith(docs + "/"):
        site_path = repo_path[len(docs) + 1:]
        if site_path in ROOT_PAGES:   # found by the site, broken on GitHub
            log.warning("%s: link %r names %s; the page is %s at the repository's root",
                        in_repo, target, repo_path, site_path)
    else:
        # Source code and other files outside the site: real on GitHub, text here.
        if not os.path.exists(os.path.join(root, repo_path)):
            log.warning("%s: link %r names %s, which does not exist", in_repo, target, repo_path)
        return text
    link = posixpath.relpath(site_path, posixpath.dirname(src_uri) or ".")
    return f"{bang}[{text}]({link}{'#' + anchor if anchor else ''}{title})"
