"""
Files written so that a crash, Ctrl-C or a full disk never leaves half of one under its final name:
atomic writes through a temporary twin, the names of those temporaries, and file checksums (a big
input's blocks hashed on all cores).
"""

import hashlib
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

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
    """The sha256 of the sha256s of the file's blocks, hashed side by side (hashlib releases the GIL):
    ~1% of the time tokenizing the file takes, however many cores do that."""
    def block(i):
        with open(path, "rb") as f:
            f.seek(i * HASH_BLOCK)
            return hashlib.sha256(f.read(HASH_BLOCK)).digest()

    blocks = max(1, -(-os.path.getsize(path) // HASH_BLOCK))
    with ThreadPoolExecutor(CPUS) as pool:
        return hashlib.sha256(b"".join(pool.map(block, range(blocks)))).hexdigest()
