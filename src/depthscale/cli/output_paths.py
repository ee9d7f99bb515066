"""Output paths of the commands, checked before any work: a run that would fail at its end, when
it writes, is refused at its start with one line naming the flag. A path whose parents do not
exist yet is allowed (they are made when the file is written, as `mkdir -p` would)."""

from __future__ import annotations

from pathlib import Path

from depthscale.errors import ConfigError


def check_output(flag: str, path: Path, directory: bool = False) -> None:
    """An output path that cannot be created is refused before any work, naming the flag: a
    regular file on its way, an unwritable parent, a directory where a file goes."""
    from depthscale.config.section_checks import check_dir_creatable

    if directory:
        check_dir_creatable(flag, path)
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; allowed: a file path")
    ancestor = path.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be created because {str(ancestor)!r} is a file; "
            "allowed: a path whose parents are directories"
        )
    check_dir_creatable(flag, path.parent)


def write_output(path: Path, text: str) -> None:
    """Write a file `check_output` accepted, making the parent directories it found creatable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
