"""File checks the command lines share (no torch import)."""

from __future__ import annotations

from pathlib import Path


def check_writable(path: str | Path, flag: str = "--json", *, make_parents: bool = False) -> Path:
    """Fail before any work if ``path`` cannot be written: ``ValueError`` naming ``flag``.
    ``make_parents``: create missing parent directories (where the file will go; they
    stay), else a missing one is an error. A file that did not exist is removed again."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    existed = path.exists()
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write ({e.strerror or e})") from None
    if not existed:
        path.unlink()
    return path
