"""The on-disk kernel cache: private directory, per-key locks, atomic install, checksums.

Layout::

    $FI_CACHE_DIR/
      modules/<name>-<key16>/{module.so, build.ninja, meta.json}
      locks/<name>-<key16>.lock        fcntl locks (released by the kernel if a process dies)
      tmp/                             builds in progress, renamed into modules/ when complete

A module is loaded only if its meta.json checksum matches module.so (a truncated or edited file
is a miss and gets rebuilt), and only from directories that no other user can write: loading a
shared library runs its code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Optional
from collections.abc import Iterator

from .. import knobs
from ..errors import CacheError

META = "meta.json"
MODULE = "module.so"


def root() -> Path:
    """The cache root, created 0700 on first use and refused if others can write to it."""
    path = knobs.cache_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot create kernel cache {path}: {exc}; set FI_CACHE_DIR") from exc
    check_private(path)
    for sub in ("modules", "locks", "tmp"):
        (path / sub).mkdir(mode=0o700, exist_ok=True)
    return path


def check_private(path: Path) -> None:
    """Refuse a directory that a user other than us (or root) can write."""
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"kernel cache {path} is writable by group or others (mode {stat.filemode(st.st_mode)}); "
            f"fi loads shared libraries from it, so it must be private: run `chmod go-w {path}` "
            f"or set FI_CACHE_DIR to a private directory")
    if st.st_uid not in (os.getuid(), 0):
        raise CacheError(
            f"kernel cache {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            f"set FI_CACHE_DIR to a directory you own")


def module_dir(dirname: str) -> Path:
    return root() / "modules" / dirname


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_meta(directory: Path) -> Optional[dict]:
    try:
        return json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None


def verify(directory: Path) -> tuple[bool, str]:
    """(ok, reason): module.so exists, is not writable by others and matches meta's checksum."""
    meta = read_meta(directory)
    so = directory / MODULE
    if meta is None:
        return False, "meta.json missing or unreadable"
    if not so.is_file():
        return False, "module.so missing"
    dmode = directory.stat().st_mode
    if dmode & (stat.S_IWGRP | stat.S_IWOTH):
        return False, f"{directory} is writable by group/others ({stat.filemode(dmode)})"
    mode = so.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False, f"module.so is writable by group/others ({stat.filemode(mode)})"
    want = meta.get("checksum")
    got = sha256_file(so)
    if want != got:
        return False, f"checksum mismatch (meta {str(want)[:12]}, file {got[:12]})"
    return True, "ok"


@contextlib.contextmanager
def lock(dirname: str) -> Iterator[None]:
    """Exclusive per-key lock. A crashed holder's lock is released by the OS (no stale files)."""
    path = root() / "locks" / f"{dirname}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def new_build_dir(dirname: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{dirname}.", dir=root() / "tmp"))


def install(build_dir: Path, dirname: str) -> Path:
    """Atomically move a finished build into place (the caller holds the key's lock)."""
    final = module_dir(dirname)
    if final.exists():
        # A bad module (failed verify) is moved aside first: os.replace cannot replace a
        # non-empty directory, and readers must never see a half-written one.
        trash = Path(tempfile.mkdtemp(prefix=f"{dirname}.old.", dir=root() / "tmp"))
        os.replace(final, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(build_dir, final)
    return final


def entries() -> list[tuple[Path, Optional[dict]]]:
    mods = root() / "modules"
    return [(d, read_meta(d)) for d in sorted(mods.iterdir()) if d.is_dir()]


def clear() -> int:
    n = 0
    for d, _ in entries():
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    shutil.rmtree(root() / "tmp", ignore_errors=True)
    (root() / "tmp").mkdir(mode=0o700, exist_ok=True)
    return n
