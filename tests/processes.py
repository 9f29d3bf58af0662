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


def _stat_fields(pid) -> list:
    """The fields of /proc/PID/stat after the command name."""
    return (pathlib.Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def children_of(pids: list) -> list:
    """Ids of live processes whose parent is one of ``pids``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(_stat_fields(entry.name)[1]) in pids:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def group_members(pgid: int) -> list:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                members.append(int(entry.name))
    return members
