"""Lock files: one writer per unit of a sweep, one run per output folder.

A lock is a small JSON file (holder's host, pid, start time and a token) created whole
(`create_lock_file`) and refreshed by a `Heartbeat`; a lock whose holder is a dead process on this
host, or that saw no heartbeat for ``timeout`` seconds, is stale and broken (`break_if_stale`).
`hold_folder` holds ``OUTDIR/measure.lock`` while `flatcli measure` writes into OUTDIR. At the
bottom of the package, beside `flatcli.tempfiles` and `flatcli.readback` (all it imports): the API
(the measure's output folder) and the sweep (its units' locks) share it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .readback import Unreadable, parse_json, read_json, read_text
from .tempfiles import clean_orphans, temp_prefix

DEFAULT_LOCK_TIMEOUT = 600.0  # seconds without a heartbeat after which a lock is stale
LOCK_BYTES = 2**16  # a lock holds host, pid, time and token: ~150 bytes


def host() -> str:
    """The name of this machine, as locks and unit records record it."""
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


@dataclass
class Lock:
    """A held unit lock; `release` removes it, `touch` refreshes its heartbeat."""

    path: Path
    token: str

    def touch(self) -> None:
        """Refresh the lock file's modification time (its heartbeat)."""
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Remove the lock file if it is still ours (its token); errors are ignored."""
        try:
            held = read_json(self.path, LOCK_BYTES)
            if isinstance(held, dict) and held.get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


class Heartbeat:
    """Touches a lock every ``interval`` seconds while a unit runs (so it never looks stale)."""

    def __init__(self, lock: Lock, interval: float):
        self.lock, self.interval = lock, max(0.05, interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.lock.touch()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def lock_is_stale(
    info: dict[str, Any], mtime: float, timeout: float, now: float | None = None
) -> bool:
    """Stale when its holder is a dead process on this host, or it saw no heartbeat for ``timeout`` s."""
    now = time.time() if now is None else now
    if now - mtime > timeout:
        return True
    if info.get("host") == host() and isinstance(info.get("pid"), int):
        return not _pid_alive(info["pid"])
    return False


def stale_reason(text: str, mtime: float, timeout: float) -> str | None:
    """Why a lock file holding ``text`` (last heartbeat ``mtime``) is stale, or None while its
    holder may be alive. Locks are created whole (`create_lock_file`), so an empty or unreadable
    one was left by a process killed while an older flatcli created it: stale at once."""
    try:
        info = parse_json(text) if text.strip() else None
    except Unreadable:
        info = None
    if not isinstance(info, dict) or not info:
        return "the lock file is empty or unreadable (its holder was killed while creating it)"
    holder = f"pid {info.get('pid')} on {info.get('host')}"
    if time.time() - mtime > timeout:
        return (
            f"no heartbeat for {time.time() - mtime:.0f} s (timeout {timeout:g} s; holder {holder})"
        )
    if lock_is_stale(info, mtime, timeout):
        return f"its holder, {holder}, is no longer running"
    return None


def lock_text(path: Path) -> str:
    """A lock file's text; '' when it is not UTF-8 or too large (then it is unreadable, hence
    stale, `stale_reason`). ``OSError`` (a missing file) as usual."""
    try:
        return read_text(path, LOCK_BYTES)
    except Unreadable:
        return ""


def create_lock_file(path: Path, info: dict[str, Any]) -> bool:
    """Create the lock file ``path`` holding ``info`` (JSON) in one step, so that no reader ever
    sees it empty: the info goes to a temp file that is hard-linked to ``path`` (which fails when
    ``path`` exists). On a file system without hard links, ``O_CREAT|O_EXCL`` then a write.
    False when the lock exists."""
    text = json.dumps(info)
    tmp = path.with_name(f"{temp_prefix(path)}{uuid.uuid4().hex}.new")
    try:
        tmp.write_text(text)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def break_if_stale(path: Path, timeout: float, log: Callable[[str], None] | None = None) -> bool:
    """Remove the lock file ``path`` when it is stale (`stale_reason`), telling ``log`` why; True
    when it was removed (or is gone), False while its holder may be alive."""
    try:
        text = lock_text(path)
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return True  # released meanwhile: try again
    why = stale_reason(text, mtime, timeout)
    if why is None:
        return False
    # Move it aside under a unique name; only one breaker wins the rename. If what we moved
    # is not the lock we judged stale (its holder replaced it meanwhile), put it back.
    aside = path.with_name(f"{temp_prefix(path)}{uuid.uuid4().hex}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True
    try:
        moved = lock_text(aside)
        if moved != text:
            try:
                os.link(aside, path)
            except OSError as e:
                if e.errno != errno.EEXIST:
                    raise
            return False
        if log is not None:
            log(f"broke the lock {path}: {why}")
        return True
    finally:
        try:
            aside.unlink()
        except OSError:
            pass


OUTDIR_LOCK = "measure.lock"


def _holder(info: dict[str, Any]) -> str:
    started = info.get("time")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        if isinstance(started, (int, float))
        else "at an unknown time"
    )
    return f"pid {info.get('pid')} on {info.get('host')}, started {when}"


@contextlib.contextmanager
def hold_folder(
    folder: Path,
    what: str = "output directory",
    timeout: float = DEFAULT_LOCK_TIMEOUT,
    log: Callable[[str], None] | None = None,
):
    """Hold ``folder/measure.lock`` (host, pid, start time; its mtime a heartbeat every
    ``timeout``/4 s) while a run writes results into ``folder``. A folder held by a live run is a
    `ConfigError` (exit code 2) naming the holder; a stale lock is broken, ``log`` told why."""
    path = Path(folder) / OUTDIR_LOCK
    for d in (Path(folder), Path(folder) / "tokenized"):
        clean_orphans(d)  # temp files of writers killed mid-write
    token = uuid.uuid4().hex
    info = {"host": host(), "pid": os.getpid(), "time": time.time(), "token": token}
    for _ in range(3):
        if create_lock_file(path, info):
            break
        try:
            held = read_json(path, LOCK_BYTES)
        except (OSError, ValueError):
            held = None
        if not break_if_stale(path, timeout, log):
            who = _holder(held) if isinstance(held, dict) else "another process"
            raise ConfigError(
                f"{what} {folder} is in use by another flatcli run ({who}); wait for it to "
                f"finish or choose another folder (a dead run's {path.name} is removed "
                f"automatically)"
            )
    else:
        raise ConfigError(f"{what} {folder}: could not take {path.name}")
    lock = Lock(path, token)
    try:
        with Heartbeat(lock, timeout / 4):
            yield lock
    finally:
        lock.release()
