"""Publishing a checkpoint directory in one step: a staging directory beside it, swapped in.

# [Note: atomic publication]
# A checkpoint folder ``path`` is complete or absent, never half-written, and a save over
# an older checkpoint leaves that one loadable until the new one is complete:
# 1. every writer writes its files into ``<path>.partial`` (a sibling: same filesystem, so
#    renames stay renames), each as ``<file>.partial``, fsync'ed, renamed within the stage
#    once every rank has written (``StreamWriter``);
# 2. rank 0 adds the index and the Hugging Face config, and carries over the files of the
#    old ``path`` that are not weights (a tokenizer, a README) by hard link (or copy);
# 3. rank 0 swaps the stage in: on Linux one ``renameat2(RENAME_EXCHANGE)`` (the old folder
#    is then at the stage's name, and removed); where that is not supported, two renames
#    (``path`` -> ``<path>.replaced``, stage -> ``path``: a crash between the two leaves the
#    complete old checkpoint at ``<path>.replaced``); then the parent directory is fsync'ed.
# A crash before step 3 leaves ``path`` untouched and a stale stage, which the next save
# removes. A ``.safetensors`` file target needs none of this: one file, one rename.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil

__all__ = ["carry_over", "fsync_dir", "prepare_stage", "replace_dir", "stage_of"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def stage_of(path: str) -> str:
    """The staging directory of checkpoint folder ``path`` (see [Note: atomic publication])."""
    return os.path.normpath(path) + ".partial"


def prepare_stage(path: str) -> str:
    """Make an empty stage for ``path`` (removing one an interrupted save left); return it."""
    stage = stage_of(path)
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    return stage


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (renames into it) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def carry_over(old: str, stage: str, weights: re.Pattern[str], index: str) -> None:
    """Hard-link (or copy) into ``stage`` the entries of the old checkpoint folder ``old``
    that are not weight files, not the index, not leftovers, and not in ``stage`` already."""
    if not os.path.isdir(old):
        return
    for entry in os.listdir(old):
        if weights.match(entry) or entry == index or entry.endswith(".partial"):
            continue
        src, dst = os.path.join(old, entry), os.path.join(stage, entry)
        if os.path.lexists(dst):
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def replace_dir(stage: str, path: str) -> None:
    """Put directory ``stage`` at ``path`` in one step, replacing what was there; remove the
    old folder. See [Note: atomic publication]."""
    fsync_dir(stage)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(stage, path)
    elif _exchange(stage, path):
        shutil.rmtree(stage)  # now the old folder
    else:
        replaced = os.path.normpath(path) + ".replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(path, replaced)
        os.rename(stage, path)
        fsync_dir(parent)
        shutil.rmtree(replaced)
    fsync_dir(parent)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    C library, kernel or filesystem does not support it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")
