"""
Files written so that a crash, Ctrl-C or a full disk never leaves half of one under its final name:
atomic writes through a temporary twin, the names of those temporaries, the files an output flag names
(checked before the work, written through links, pipes and devices written in place), file checksums (a big
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

# -----------------------------------------------------------------------------
# Files an output flag names (evaluate.py --json, plot_log.py --out)


def descriptor_of(path):
    """(process id, descriptor number) when path names an open descriptor (/dev/stdout, /dev/fd/1, /proc/self/fd/1),
    links followed one at a time; else None. The kernel's link of such a name points at whatever the descriptor
    holds (a pipe, a terminal, the file a shell redirected to), which only writing through the name reaches."""
    path = os.path.abspath(path)
    for _ in range(40):  # the kernel's limit on links in a row
        path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if m := re.fullmatch(r"/proc/(\d+)/(?:task/\d+/)?fd/(\d+)", path):
            return int(m.group(1)), int(m.group(2))
        if not os.path.islink(path):
            return None
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return None


def written_in_place(path):
    """Whether an output file is opened and written where it is rather than replaced through a temporary twin:
    a FIFO, a character device (/dev/null, a terminal) or one of our descriptors. Replacing one would take it
    from its reader, or turn a device node into a file (as root)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or descriptor_of(path) is not None


def check_output_file(path, flag):
    """Refuse in one line, before the work whose result it will hold, a file named by `flag` that cannot be
    written: a folder, a block device or socket, a path in a missing folder, a folder we may not create files in.
    Nothing is changed (a probe file under a temporary name is created and removed)."""
    if not path:
        raise UserError(f"{flag} is empty; give a file name")
    if path.endswith(("/", os.sep)) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} ends in '/', which names a folder, not a file; give a file name "
                        f"(e.g. {os.path.join(path, 'result.json')})")
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None  # a new file, or a link to one; a path through a file is a missing folder's, below
    except OSError as e:  # a loop of links, a name too long
        raise UserError(f"cannot write {flag} {path} ({e.strerror or e}); give another file") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UserError(f"{flag} {path} is a folder; give a file name")
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        raise UserError(f"{flag} {path} is neither a file, a FIFO nor a character device; give a file name")
    if written_in_place(path):
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag} {path} cannot be written (permission denied); give another file")
        return
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: the folder {folder} does not exist; create it or give another path")
    probe = temporary_name(target)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create a file in {folder} ({e.strerror or e}); "
                        "give another path") from None


@contextmanager
def output_file(path, mode="w"):
    """Write a file an output flag names (checked first with check_output_file). A FIFO, character device or
    descriptor (written_in_place) is opened and written; anything else is atomic_write's, through links: the
    file a link points to is replaced and the link kept."""
    if not written_in_place(path):
        with atomic_write(os.path.realpath(path), mode) as f:
            yield f
        return
    sys.stdout.flush()  # what was printed before it comes first on /dev/stdout
    sys.stderr.flush()
    owner = descriptor_of(path)
    if owner is not None and owner[0] == os.getpid():
        fd = os.dup(owner[1])  # our own descriptor, its offset shared: what is printed next follows, never overwrites
    else:  # never created or truncated; appended, as a reopened descriptor of a file shares no offset with its owner
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, mode) as f:  # fdopen truncates nothing
        yield f


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


@contextmanager
def clearing_new_folders(folder):
    """The folders of folder's path that do not exist when the block starts (folder too) are removed at its end if
    they are empty then (the block made them, then was refused or failed), the deepest first: one that holds
    something stays, and so do those above it."""
    new, parent = [], os.path.abspath(folder)
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        new.append(parent)
        parent = os.path.dirname(parent)
    try:
        yield
    finally:
        for path in new:
            with suppress(OSError):
                os.rmdir(path)


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
