"""Crash-safe overwrites: a process killed at any moment leaves the old file (or directory) or the
new one, never a mix, a truncated file or nothing.

A file is written to a temporary name beside it, flushed to disk, then renamed over the old one
(``os.replace`` is atomic). A directory (an orbax checkpoint) is written complete under
``<path>.new``, then exchanged with the old one in one step (Linux ``renameat2(RENAME_EXCHANGE)``);
where the file system cannot exchange, the old directory is renamed to ``<path>.old`` and the new
one into place, and :func:`readable_directory` finds a complete one if a crash fell between the
two renames.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
>>> write_file(path, "old")
>>> write_file(path, "new")
>>> open(path).read(), sorted(os.listdir(os.path.dirname(path)))
('new', ['plan.json'])
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile

__all__ = ["readable_directory", "replace_directory", "staging_directory", "write_file"]

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _fsync_directory(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not on every platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` by ``text`` atomically (see the module docstring)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(folder)


def staging_directory(path: str | os.PathLike) -> str:
    """Where the new version of directory ``path`` is written before :func:`replace_directory`;
    leftovers of an earlier interrupted write there are removed."""
    path = os.path.abspath(path)
    new = path + ".new"
    folder, name = os.path.split(new)
    if os.path.isdir(folder):
        for entry in os.listdir(folder):  # e.g. orbax's <name>.orbax-checkpoint-tmp-<n> of a killed save
            if entry == os.path.basename(new) or entry.startswith(os.path.basename(new) + "."):
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    return new


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_directory(new: str, path: str | os.PathLike) -> None:
    """Put the complete directory ``new`` (from :func:`staging_directory`) in the place of ``path``."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.exists(path):
        os.rename(new, path)
    elif _exchange(new, path):
        shutil.rmtree(new)  # now the old version
    else:
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(new, path)  # a crash before this line: readable_directory finds new
        shutil.rmtree(old)
    _fsync_directory(folder)


def readable_directory(path: str | os.PathLike) -> str:
    """``path``, or where its complete version is if a crash fell inside :func:`replace_directory`.

    >>> readable_directory("/no/such/checkpoint")
    '/no/such/checkpoint'
    """
    path = os.path.abspath(path)
    if os.path.exists(path):
        return path
    for candidate in (path + ".new", path + ".old"):  # .new exists only once complete
        if os.path.isdir(candidate):
            return candidate
    return path
