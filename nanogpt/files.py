"""
Files written so that a crash, Ctrl-C or a full disk never leaves half of one under its final name:
atomic writes through a temporary twin, the names of those temporaries, file checksums (a big
input's blocks hashed on all cores), and the lock that keeps a second writer out of a folder.
"""

import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress

from nanogpt.cli import UserError

# the cores this process may run on (os.cpu_count() counts those it may not)
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
HASH_BLOCK = 1 << 23  # an input is known by the sha256 of its 8 MiB blocks' sha256s


def temporary_name(path):
    """A new name beside path to write it under first: <path>.<8 hex digits>.tmp, created exclusively,
    so no file of the user's (a path.tmp of theirs, say) is ever taken over."""
    return f"{path}.{secrets.token_hex(4)}.tmp"

def temporary_of(name):
    """The name a temporary_name() file was written for; None for other names (a user's <name>.tmp too).
    What a killed process leaves behind, for the next run to clear."""
    m = re.fullmatch(r"(.+)\.[0-9a-f]{8}\.tmp", name)
    return m and m.group(1)

@contextmanager
def atomic_write(path, mode="wb"):
    """Write path through a temporary twin: fsynced and renamed over path when the block succeeds,
    removed when it fails. A crash, Ctrl-C or full disk never leaves a partial file under path, and
    never harms the file that was there."""
    tmp = temporary_name(path)
    try:
        with open(tmp, mode.replace("w", "x")) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))

def disk_advice(e):
    """'free disk space or ' where the OSError e is a full disk or quota, else '' (a folder in the way, a
    permission, a file size limit: freeing space would not help). Rust's errors (safetensors') end in `(os error N)`."""
    full = (errno.ENOSPC, errno.EDQUOT)
    return "free disk space or " if (getattr(e, "errno", None) in full
                                     or any(f"(os error {n})" in str(e) for n in full)) else ""


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()

def content_hash(path):
    """The sha256 of the sha256s of the file's blocks, hashed side by side: ~1% of the time tokenizing the
    file takes, however many cores do that."""
    def read(start, end):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    with ThreadPoolExecutor(CPUS) as pool:
        return hashlib.sha256(block_digests(os.path.getsize(path), read, pool)).hexdigest()

def block_digests(size, read, pool):
    """The sha256s of the HASH_BLOCK-byte blocks of `size` bytes (one empty block if none), read(start, end)
    giving each block's bytes, hashed side by side on the pool's threads (hashlib releases the GIL)."""
    def digest(start):
        return hashlib.sha256(read(start, start + HASH_BLOCK)).digest()

    return b"".join(pool.map(digest, range(0, max(size, 1), HASH_BLOCK)))


def lock_folder(folder, lock_name, flag, writer):
    """Take the lock that keeps a second writer out of `folder` while this one uses it (held until
    unlock_folder or the end of the process): an open file descriptor of folder/lock_name, or None where
    fcntl does not exist (Windows) or the file system has no locks. A folder another live process holds is
    refused in one line naming it (`flag` is the option that named the folder, `writer` what the holder is:
    "another training run"), and nothing in it is changed. The kernel drops a flock when its process dies,
    SIGKILL included, so the lock file a killed writer leaves never blocks. Readers take no lock."""
    try:
        import fcntl
    except ImportError:
        return None
    path = os.path.join(folder, lock_name)
    not_a_file = (f"{path} is not a regular file (a link or a folder); remove it, or give another {flag} "
                  "(nothing was changed)")
    while True:
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # a link is never followed
            raise UserError(not_a_file)
        try:  # Python's descriptors are close-on-exec: a child process (W&B's service) does not hold the lock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0),
                         0o644)
        except OSError as e:
            raise UserError(f"cannot create {path} ({e.strerror or e}); pick another {flag}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # made a link or a fifo since the check above
            os.close(fd)
            raise UserError(not_a_file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise UserError(f"{flag} {folder} is in use by {writer}{holder}; wait for it to end, "
                            f"or give another {flag} (nothing was changed)") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: a file system without locks, where the file means nothing
            os.close(fd)
            with suppress(OSError):
                os.remove(path)
            print(f"warning: cannot lock {flag} {folder} ({e.strerror or e}); nothing keeps a second writer "
                  "out of it", file=sys.stderr)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the process that held it removed the file as it ended: lock the file now under that name
    with suppress(OSError):  # who holds it, for the message of a writer refused; only a courtesy (a full disk)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    return fd


def lock_holder(fd):
    """' (process PID on HOST)' from a lock file's text, or '' when it does not say."""
    with suppress(OSError):
        m = re.fullmatch(r"(\d+) (\S+)\n", os.pread(fd, 300, 0).decode(errors="replace"))
        if m:
            return f" (process {m.group(1)} on {m.group(2)})"
    return ""


def unlock_folder(folder, lock_name, fd):
    """Remove the lock file and release the lock: the folder is left as its writer made it. Removed while
    still held, so a process that opened the file meanwhile finds it gone and locks the new one."""
    if fd is None:
        return
    path = os.path.join(folder, lock_name)
    with suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.remove(path)
    os.close(fd)
