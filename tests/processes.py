"""Finding live processes by their command line, for tests that check what a
server leaves behind."""
import pathlib


def processes_mentioning(text: str) -> list:
    """Ids of live processes whose command line (arguments joined by NUL) contains ``text``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
