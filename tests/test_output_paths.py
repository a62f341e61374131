"""nanogpt.files' output files (what evaluate.py --json and plot_log.py --out write): a link's target is replaced
and the link kept; a FIFO, a character device and a descriptor (/dev/stdout) are written in place; a path that
cannot be written is refused in one line before any work. The scripts' own tests run them on these paths."""

import os
import socket
import stat

import pytest

from conftest import descriptor_link, fifo_with_reader, safe_char_device
from nanogpt.cli import UserError
from nanogpt.files import check_output_file, output_file

TEXT = '{"core": 0.5}\n'


def write(path):
    check_output_file(path, "--json")
    with output_file(path, "w") as f:
        f.write(TEXT)


def test_a_link_keeps_its_place_and_its_target_is_replaced(tmp_path):
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "core.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    os.symlink(os.path.join("runs", "core.json"), link)
    write(str(link))
    assert os.readlink(link) == os.path.join("runs", "core.json") and target.read_text() == TEXT
    assert os.listdir(tmp_path / "runs") == ["core.json"]  # through a temporary twin, nothing left beside it
    # a link to a file not there yet: the file is made where the link points
    os.symlink("new.json", tmp_path / "dangling.json")
    write(str(tmp_path / "dangling.json"))
    assert os.readlink(tmp_path / "dangling.json") == "new.json" and (tmp_path / "new.json").read_text() == TEXT


def test_a_fifo_is_written_to_its_reader(tmp_path):
    fifo = str(tmp_path / "core.json")
    reader, got = fifo_with_reader(fifo)
    write(fifo)
    reader.join(timeout=60)
    assert not reader.is_alive() and got == [TEXT.encode()]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["core.json"]


def test_a_character_device_is_written_in_place(tmp_path):
    device = safe_char_device(tmp_path)
    rdev = os.stat(device).st_rdev
    write(device)
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == rdev


def test_a_descriptor_is_written_where_it_stands_not_replaced(tmp_path):
    """A link to /proc/self/fd/N, as /dev/stdout is: the file the descriptor holds (a shell's `> out.txt`) keeps
    what was printed into it, the JSON follows, and what is printed after follows the JSON."""
    redirected = tmp_path / "out.txt"
    with open(redirected, "w") as f:
        f.write("the table\n")
        f.flush()
        link = descriptor_link(tmp_path, f)
        write(link)
        f.write("wrote it\n")
        assert os.readlink(link) == f"/proc/self/fd/{f.fileno()}"
    assert redirected.read_text() == "the table\n" + TEXT + "wrote it\n"
    assert sorted(os.listdir(tmp_path)) == ["out.txt", "stdout"]


def test_what_cannot_be_written_is_refused_in_one_line(tmp_path):
    (tmp_path / "a_file").write_text("mine")
    os.symlink("loop", tmp_path / "loop")
    bad = [(str(tmp_path), "is a folder"), (str(tmp_path / "no" / "x.json"), "does not exist"),
           (str(tmp_path / "a_file" / "x.json"), "does not exist"), (str(tmp_path / "loop"), "links"),
           ("/proc/x.json", "cannot create a file in /proc"), ("", "--json is empty"),
           (str(tmp_path / ("x" * 300)), "cannot write")]
    try:
        os.mknod(tmp_path / "disk", 0o600 | stat.S_IFBLK, os.makedev(7, 0))  # a node only, never opened
        bad.append((str(tmp_path / "disk"), "neither a file, a FIFO nor a character device"))
    except OSError:
        pass
    sock = socket.socket(socket.AF_UNIX)  # a socket, and a descriptor of one (/dev/stdout of a service)
    sock.bind(str(tmp_path / "sock"))
    bad += [(str(tmp_path / "sock"), "neither"), (f"/proc/self/fd/{sock.fileno()}", "neither")]
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        bad.append((str(tmp_path / "locked" / "x.json"), "Permission denied"))
    before = sorted(os.listdir(tmp_path))
    for path, needle in bad:
        with pytest.raises(UserError, match=needle) as e:
            check_output_file(path, "--json")
        assert "\n" not in str(e.value)
    sock.close()
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "a_file").read_text() == "mine"


def test_a_name_ending_in_a_slash_is_refused(tmp_path):
    """evaluate.py --json runs/ (a folder meant, not made yet): one line, and no file named runs is written."""
    with pytest.raises(UserError, match="ends in '/', which names a folder") as e:
        check_output_file(str(tmp_path / "runs") + "/", "--json")
    assert "\n" not in str(e.value) and os.listdir(tmp_path) == []
