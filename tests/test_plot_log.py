"""plot_log.py: parses build-nanogpt's log format (any kind of line), builds the panels that fit the
run (checked on the matplotlib Figure, not on pixels), writes a readable PNG, and never overwrites the
log or another non-PNG file; bad lines are named."""

import math
import os
import stat
import statistics

import pytest

import plot_log
from conftest import ROOT, assert_one_line_error, run_script, safe_char_device
from nanogpt.cli import UserError

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

LOG = """0 val_fineweb_edu 1
0 val 10.9876
0 hella 0.2500
0 train 10.991234
1 train 9.500000
2 train nan skipped
3 train 7.250000

5 val 3.9000
5 hella 0.2710
4 train 3.950000
5 train 3.500000
"""


# Published reference numbers, typed in from their source, not read from plot_log: build-nanogpt's
# play.ipynb (karpathy/build-nanogpt) plots loss_baseline["124M"] = 3.2924 (OpenAI GPT-2 124M on the
# FineWeb-Edu val split), hella2_baseline["124M"] = 0.294463 (GPT-2 124M HellaSwag acc_norm, as its
# training loop scores it), hella3_baseline["124M"] = 0.337 (GPT-3 paper, 125M), with plt.ylim(top=4.0)
# on the loss panel. HellaSwag has four endings: chance is 1/4.
PUBLISHED_GPT2_VAL_LOSS = 3.2924
PUBLISHED_GPT2_HELLASWAG = 0.294463
PUBLISHED_GPT3_HELLASWAG = 0.337
PUBLISHED_LOSS_TOP = 4.0
# nanochat's CORE of OpenAI's GPT-2 124M and 350M (its README's "GPT-2 quality" table, DCLM's 22 tasks)
PUBLISHED_GPT2_124M_CORE = 0.1139
PUBLISHED_GPT2_350M_CORE = 0.1849


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_parse_log_series(tmp_path):
    series = plot_log.parse_log(write(tmp_path / "log.txt", LOG))
    assert sorted(series) == ["hella", "skipped", "train", "val", "val_fineweb_edu"]  # `2 train nan skipped`: not applied
    assert series["train"] == ([0, 1, 3, 4, 5], [10.991234, 9.5, 7.25, 3.95, 3.5])
    steps, values = series["skipped"]
    assert steps == [2] and math.isnan(values[0])
    assert series["val"] == ([0, 5], [10.9876, 3.9])
    assert series["hella"] == ([0, 5], [0.25, 0.271])
    assert plot_log.finite([0, 1, 2, 3], [9.5, float("nan"), float("inf"), 7.25]) == ([0, 3], [9.5, 7.25])
    # a step logged twice keeps the later line
    series = plot_log.parse_log(write(tmp_path / "dup.txt", "1 val 5.0\n2 val 4.0\n1 val 4.5\n"))
    assert series["val"] == ([1, 2], [4.5, 4.0])


def test_writes_png(tmp_path):
    import matplotlib.pyplot as plt

    log_dir = tmp_path / "log"
    log_dir.mkdir()
    write(log_dir / "log.txt", LOG)
    r = run_script(["plot_log.py", str(log_dir / "log.txt")])
    assert r.returncode == 0, r.stderr
    out = log_dir / "plot.png"  # the default: beside the log
    assert str(out) in r.stdout
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(str(out))
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0  # something was drawn
    assert sorted(os.listdir(log_dir)) == ["log.txt", "plot.png"]  # no temporary file left
    # in-process, a folder and --out; a log without HellaSwag lines still plots
    other = str(tmp_path / "other.png")
    write(log_dir / "log.txt", "0 train 11.0\n1 train 10.5\n")
    assert plot_log.main([str(log_dir), "--out", other]) == other
    assert plt.imread(other).shape[0] > 100


@pytest.mark.parametrize("line", ["5 train", "x val 3.2", "5 3.2 val", "5 val abc", "5 val 3.2 extra", "-1 val 3.2",
                                  "5 val 3.2 skipped", "5 7up 3.2", "5 va:l 3.2", "5.0 val 3.2"])
def test_malformed_line_names_it(tmp_path, line):
    path = write(tmp_path / "log.txt", "0 train 11.0\n" + line + "\n")
    with pytest.raises(UserError, match=f"{path}:2: "):
        plot_log.parse_log(path)


@pytest.mark.parametrize("partial", ["2 va", "2 val 3.", "2"])
def test_a_last_line_still_being_written_is_left_out(tmp_path, partial):
    """A run appends `<step> <kind> <value>\n` as it goes: a log read mid-write may end in part of a line (no
    newline yet), which is neither refused nor read as a number it is not."""
    series = plot_log.parse_log(write(tmp_path / "log.txt", "0 train 11.0\n1 train 10.5\n" + partial))
    assert series == {"train": ([0, 1], [11.0, 10.5])}


def test_cli_errors_are_one_line(tmp_path):
    path = write(tmp_path / "log.txt", "0 train 11.0\n1 train oops\n")
    assert_one_line_error(run_script(["plot_log.py", path]), f"{path}:2")
    assert not os.path.exists(tmp_path / "plot.png")
    with pytest.raises(UserError, match="does not exist"):
        plot_log.main([str(tmp_path / "missing.txt")])
    with pytest.raises(UserError, match="no log lines"):
        plot_log.main([write(tmp_path / "empty.txt", "\n")])


def test_any_kind_is_a_series(tmp_path):
    """A new evaluation (mmlu), the learning rate or a named loss need no change in plot_log."""
    path = write(tmp_path / "log.txt", "0 mmlu 0.25\n0 lr 6e-4\n10 lr 3e-4\n10 mmlu 0.31\n0 distill_loss 2.5\n")
    series = plot_log.parse_log(path)
    assert list(series) == ["mmlu", "lr", "distill_loss"]  # order of first appearance
    assert series["lr"] == ([0, 10], [6e-4, 3e-4]) and series["mmlu"] == ([0, 10], [0.25, 0.31])


# -----------------------------------------------------------------------------
# the Figure: which panels, which lines, what data


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def find(labels, prefix):
    hits = [k for k in labels if k.startswith(prefix)]
    assert len(hits) == 1, (prefix, list(labels))
    return labels[hits[0]]


def figure(tmp_path, text, **kw):
    return plot_log.build_figure(plot_log.parse_log(write(tmp_path / "log.txt", text)), **kw)


def test_panels_and_their_data(tmp_path):
    text = LOG + "0 lr 6e-4\n5 lr 5.5e-4\n5 mmlu 0.31\n5 distill_loss 3.7\n"
    fig = figure(tmp_path, text, title="run")
    assert [ax.get_title() for ax in fig.axes] == ["loss", "HellaSwag", "lr", "mmlu"]
    loss, hella, lr, mmlu = fig.axes
    labels = lines_by_label(loss)
    train = find(labels, "train loss")
    assert list(train.get_xdata()) == [0, 1, 3, 4, 5]  # the skipped nan step is left out
    assert list(train.get_ydata()) == [10.991234, 9.5, 7.25, 3.95, 3.5]
    assert list(find(labels, "val loss").get_ydata()) == [10.9876, 3.9]
    assert list(find(labels, "distill_loss").get_xdata()) == [5]  # a kind ending in 'loss' joins the losses
    lo, hi = loss.get_ylim()  # came down through 4.0: zoomed to the run's lowest and GPT-2's line, and every val point
    assert lo < min(3.5, PUBLISHED_GPT2_VAL_LOSS) and hi > 10.9876
    assert list(find(labels, "OpenAI GPT-2").get_ydata()) == [PUBLISHED_GPT2_VAL_LOSS] * 2
    assert list(find(lines_by_label(lr), "lr").get_ydata()) == [6e-4, 5.5e-4]
    assert list(find(lines_by_label(mmlu), "mmlu").get_ydata()) == [0.31]
    assert fig._suptitle.get_text() == "run"
    # HellaSwag: the run, and chance always; GPT-2's 0.2945 and GPT-3's 0.337 lie above a 0.25-0.27 run's picture
    labels = lines_by_label(hella)
    assert list(find(labels, "acc_norm").get_ydata()) == [0.25, 0.271]
    assert list(find(labels, "chance").get_ydata()) == [0.25, 0.25]
    assert hella.get_ylim()[1] < PUBLISHED_GPT2_HELLASWAG and not any("OpenAI" in k for k in labels)


def test_reference_lines_only_inside_the_picture(tmp_path):
    # a short run, 11 -> 6: GPT-2's 3.29 would squash it, so it is left out, and no HellaSwag panel
    fig = figure(tmp_path, "".join(f"{s} train {11 - s / 2}\n" for s in range(11)) + "10 val 6.1\n")
    assert [ax.get_title() for ax in fig.axes] == ["loss"]
    assert not any("GPT-2" in k for k in lines_by_label(fig.axes[0]))
    lo, hi = fig.axes[0].get_ylim()
    assert 5.5 < lo < 6.0 and 11.0 < hi < 11.5  # fitted to the data
    # a run from 3.6 down to 3.25 without a 4.0 crossing: the line is in its range
    fig = figure(tmp_path, "0 val_fineweb_edu 1\n0 val 3.6\n1 val 3.25\n")
    assert list(find(lines_by_label(fig.axes[0]), "OpenAI GPT-2").get_ydata()) == [PUBLISHED_GPT2_VAL_LOSS] * 2
    # HellaSwag at 0.30-0.34: both references
    fig = figure(tmp_path, "0 hella 0.30\n1 hella 0.34\n")
    assert [ax.get_title() for ax in fig.axes] == ["HellaSwag"]  # no losses logged: no loss panel
    labels = lines_by_label(fig.axes[0])
    assert abs(find(labels, "OpenAI GPT-2").get_ydata()[0] - PUBLISHED_GPT2_HELLASWAG) <= 5e-5
    assert list(find(labels, "OpenAI GPT-3").get_ydata()) == [PUBLISHED_GPT3_HELLASWAG] * 2
    assert list(find(labels, "chance").get_ydata()) == [0.25] * 2


def test_core_gets_a_panel_with_gpt2s_scores_where_they_are_in_view(tmp_path):
    """`core` lines (--core_every) are drawn on their own panel, after HellaSwag, with GPT-2 124M's and 350M's
    CORE once the run's values reach them; an early run's low scores are not squashed by them."""
    fig = figure(tmp_path, "0 hella 0.25\n0 core 0.01\n1 core 0.12\n2 core 0.2\n5 mmlu 0.3\n")
    assert [ax.get_title() for ax in fig.axes] == ["HellaSwag", "CORE", "mmlu"]
    labels = lines_by_label(fig.axes[1])
    assert list(find(labels, "CORE").get_ydata()) == [0.01, 0.12, 0.2]
    assert list(find(labels, "OpenAI GPT-2 (124M)").get_ydata()) == [PUBLISHED_GPT2_124M_CORE] * 2
    assert list(find(labels, "OpenAI GPT-2 (350M)").get_ydata()) == [PUBLISHED_GPT2_350M_CORE] * 2
    early = figure(tmp_path, "0 core -0.02\n10 core 0.03\n")
    assert [ax.get_title() for ax in early.axes] == ["CORE"]
    assert not any("OpenAI" in k for k in lines_by_label(early.axes[0])) and early.axes[0].get_ylim()[1] < 0.1


def assert_references_inside(ax):
    """Every reference line drawn lies inside the panel's y-range, which it did not widen."""
    lo, hi = ax.get_ylim()
    assert all(lo <= line.get_ydata()[0] <= hi for k, line in lines_by_label(ax).items() if k.startswith("OpenAI"))


def test_zoom_keeps_every_val_point_and_no_zoom_every_point(tmp_path):
    """Once the run comes down through 4.0 the loss panel zooms to 2.8-4.0, but it crops only the train loss: one
    noisy train point under 4.0 while val is still at 10.7-5.9 keeps the whole val curve in the picture. Reference
    lines are drawn only inside the picture. --no_zoom fits every train and val point."""
    train = "".join(f"{s} train {10.9 - 0.3 * s}\n" for s in range(21)) + "21 train 3.95\n"
    fig = figure(tmp_path, train + "0 val 10.7\n10 val 7.5\n20 val 5.9\n")
    lo, hi = fig.axes[0].get_ylim()
    assert lo <= 3.95 and hi >= 10.7  # every val point, and the lowest train one
    assert_references_inside(fig.axes[0])
    # val under 4.0 all along: build-nanogpt's top, the early train loss cropped; GPT-2's line inside
    text = "0 val_fineweb_edu 1\n" + "".join(f"{s} train {11 - 0.8 * s}\n" for s in range(10)) + "5 val 3.9\n9 val 3.85\n"
    fig = figure(tmp_path, text)
    lo, hi = fig.axes[0].get_ylim()
    assert lo <= 2.8 and hi == PUBLISHED_LOSS_TOP
    assert list(find(lines_by_label(fig.axes[0]), "OpenAI GPT-2").get_ydata()) == [PUBLISHED_GPT2_VAL_LOSS] * 2
    # --no_zoom: 3.8 to 11, every point; GPT-2's 3.29 lies below that picture, so it is not drawn
    fig = figure(tmp_path, text, zoom=False)
    lo, hi = fig.axes[0].get_ylim()
    assert PUBLISHED_GPT2_VAL_LOSS < lo <= 3.8 and hi >= 11
    assert not any("GPT-2" in k for k in lines_by_label(fig.axes[0]))
    log, out = str(tmp_path / "log.txt"), str(tmp_path / "plot.png")
    assert plot_log.build_parser().parse_args([log, "--no_zoom"]).zoom is False
    assert plot_log.main([log, "--no_zoom", "--out", out]) == out and (tmp_path / "plot.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("k", [2, 3, 100])
def test_smooth_is_a_trailing_moving_average(tmp_path, k):
    raw = [10.0, 9.0, float("nan"), 7.5, 8.0, 6.0, 6.5, 5.0, 5.5, 5.2]
    fig = figure(tmp_path, "".join(f"{s} train {v}\n" for s, v in enumerate(raw)), smooth=k)
    labels = lines_by_label(fig.axes[0])
    assert len(labels) == 2  # raw + average; 5-10 does not reach near 3.29
    finite = [v for v in raw if not math.isnan(v)]
    want = [statistics.fmean(finite[max(0, i - k + 1): i + 1]) for i in range(len(finite))]
    avg = find(labels, "train loss, mean of last")
    assert list(avg.get_xdata()) == [s for s, v in enumerate(raw) if not math.isnan(v)]
    assert avg.get_ydata() == pytest.approx(want, rel=1e-12)
    lines = fig.axes[0].get_lines()
    assert lines.index(avg) > lines.index(find(labels, "train loss ("))  # drawn over the raw curve
    # off by default, and 1 is the raw curve itself
    for smooth in (0, 1):
        assert len(figure(tmp_path, "0 train 9\n1 train 8\n", smooth=smooth).axes[0].get_lines()) == 1


# -----------------------------------------------------------------------------
# --out never destroys the log or another file


PNG = b"\x89PNG\r\n\x1a\n"


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_out_refuses_the_log_and_non_png_files(tmp_path):
    log = write(tmp_path / "log.txt", LOG)
    notes = write(tmp_path / "notes.txt", "my notes")
    empty = write(tmp_path / "empty.png", "")  # named .png, but not one
    os.symlink(log, tmp_path / "link.png")  # the log under another name
    before = snapshot(tmp_path)
    # through the real command line once: one line, exit 2, nothing changed
    r = run_script(["plot_log.py", log, "--out", log])
    assert_one_line_error(r, "--out", "is the log")
    assert r.returncode == 2 and r.stdout == ""
    for out, needle in [(log, "is the log"), (str(tmp_path / "link.png"), "is the log"), (notes, "ending in .png"),
                        (empty, "not a PNG"), (str(tmp_path), "is a folder"), (str(tmp_path / "no" / "plot.png"), "does not exist")]:
        with pytest.raises(UserError, match=needle):
            plot_log.main([log, "--out", out])
    assert snapshot(tmp_path) == before
    # the default plot.png is checked the same way
    write(tmp_path / "plot.png", "not a plot")
    with pytest.raises(UserError, match="not a PNG"):
        plot_log.main([str(tmp_path)])
    assert (tmp_path / "plot.png").read_text() == "not a plot"
    # a new file, or an existing PNG (an earlier plot), is written
    new = str(tmp_path / "new.png")
    assert plot_log.main([log, "--out", new]) == new
    old = tmp_path / "old.png"
    old.write_bytes(PNG + b"an old plot")
    plot_log.main([log, "--out", str(old)])
    assert old.read_bytes().startswith(PNG) and len(old.read_bytes()) > 1000
    assert (tmp_path / "log.txt").read_text() == LOG


def test_out_through_a_link_replaces_the_png_it_points_to(tmp_path):
    """--out latest.png -> runs/run1.png, a link to an earlier plot: the plot is written there, the link stays."""
    log = write(tmp_path / "log.txt", LOG)
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "run1.png"
    target.write_bytes(PNG + b"an old plot")
    link = tmp_path / "latest.png"
    os.symlink(os.path.join("runs", "run1.png"), link)
    plot_log.main([log, "--out", str(link)])
    assert os.readlink(link) == os.path.join("runs", "run1.png")
    assert target.read_bytes().startswith(PNG) and len(target.read_bytes()) > 1000
    assert sorted(os.listdir(tmp_path / "runs")) == ["run1.png"]


def test_out_into_a_character_device_is_written_in_place(tmp_path):
    """A device is no earlier plot to check (its head is its own, never a PNG's): it is written, and stays one."""
    log = write(tmp_path / "log.txt", LOG)
    device = safe_char_device(tmp_path)
    rdev = os.stat(device).st_rdev
    out = str(tmp_path / "null.png")  # --out must end in .png: a link of that name to the device
    os.symlink(device, out)
    assert plot_log.main([log, "--out", out]) == out
    assert os.readlink(out) == device and stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == rdev


def test_out_that_cannot_be_written_is_refused_before_the_log_is_read(tmp_path):
    """A place no file can be made in is refused first (a missing log would be named otherwise)."""
    missing_log = str(tmp_path / "log.txt")
    assert_one_line_error(run_script(["plot_log.py", missing_log, "--out", "/proc/plot.png"]),
                          "--out /proc/plot.png", "cannot create a file in /proc")
    assert os.listdir(tmp_path) == []


def test_out_must_be_named_png_before_any_work(tmp_path):
    """The plot is a PNG: --out x.svg (or .png.txt, or no extension) is refused before the log is read (a bad
    log line would be named otherwise), and nothing is written; .PNG in capitals is a PNG name."""
    bad_log = write(tmp_path / "log.txt", "0 train 11.0\nnot a log line\n")
    assert_one_line_error(run_script(["plot_log.py", bad_log, "--out", str(tmp_path / "plot.svg")]),
                          f"--out {tmp_path / 'plot.svg'}", "ending in .png")
    for name in ("plot.svg", "plot.png.txt", "plot", "plot.jpg"):
        with pytest.raises(UserError, match="ending in .png"):
            plot_log.main([bad_log, "--out", str(tmp_path / name)])
    assert sorted(os.listdir(tmp_path)) == ["log.txt"]
    log = write(tmp_path / "log.txt", "0 train 11.0\n1 train 10.0\n")
    out = str(tmp_path / "PLOT.PNG")
    assert plot_log.main([log, "--out", out]) == out
    assert (tmp_path / "PLOT.PNG").read_bytes().startswith(PNG)


def test_kinds_without_a_finite_value_are_left_out(tmp_path):
    """A kind logged only as nan or inf gets no line and no panel; a log with nothing finite (a run that
    diverged at once, or only skipped steps) is one line, and no plot is written."""
    fig = figure(tmp_path, "0 train nan\n1 train inf\n0 val 5.0\n1 val 4.5\n0 lr -inf\n0 mmlu 0.3\n1 mmlu nan\n")
    assert [ax.get_title() for ax in fig.axes] == ["loss", "mmlu"]
    assert list(lines_by_label(fig.axes[0])) == ["val loss (last 4.5)"]
    assert list(find(lines_by_label(fig.axes[1]), "mmlu").get_ydata()) == [0.3]
    for text in ("0 train nan\n1 train nan\n", "0 train inf\n0 hella nan\n0 lr nan\n", "2 skipped 3.5\n"):
        log = write(tmp_path / "log.txt", text)
        out = tmp_path / "plot.png"
        r = run_script(["plot_log.py", log, "--out", str(out)])
        assert_one_line_error(r, f"{log} holds no finite values to plot")
        assert not out.exists()


def test_no_torch_even_when_plotting(tmp_path):
    log = write(tmp_path / "log.txt", LOG)
    code = (f"import sys, plot_log; assert 'torch' not in sys.modules; plot_log.main([{log!r}]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = run_script(["-c", code])
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "plot.png", "rb") as f:
        assert f.read(8) == PNG


def test_a_skipped_step_is_not_plotted_in_either_format(tmp_path):
    """`<step> skipped <loss>` (and older logs' `<step> train <loss> skipped`) is a step not applied: no point
    on the train curve, even with a finite loss, and no panel of its own."""
    for skipped in ("2 skipped 123456.0", "2 train 123456.0 skipped"):
        fig = figure(tmp_path, f"0 train 10.5\n1 train 9.5\n{skipped}\n3 train 8.5\n")
        assert [ax.get_title() for ax in fig.axes] == ["loss"]
        train = find(lines_by_label(fig.axes[0]), "train loss")
        assert list(train.get_xdata()) == [0, 1, 3] and list(train.get_ydata()) == [10.5, 9.5, 8.5]


def test_a_long_run_is_drawn_thinned_with_its_extremes(tmp_path):
    """Millions of points overflow Agg's path limit (a traceback at savefig): a line is drawn from at most
    MAX_POINTS of them, each run of consecutive points kept as its lowest and highest, so every spike and
    the overall range are still drawn; the labels still give the last logged value."""
    n = 5 * plot_log.MAX_POINTS + 123
    values = [3.0 + 0.001 * ((s * 7919) % 101) for s in range(n)]
    values[31337] = 9.5  # one spike, and one dip
    values[n - 5] = 1.25
    fig = figure(tmp_path, "".join(f"{s} train {v}\n" for s, v in enumerate(values)), smooth=10)
    labels = lines_by_label(fig.axes[0])
    train = find(labels, "train loss (")
    xs, ys = list(train.get_xdata()), list(train.get_ydata())
    assert len(xs) <= plot_log.MAX_POINTS and xs == sorted(xs) and xs[0] == 0
    assert 31337 in xs and ys[xs.index(31337)] == 9.5 and n - 5 in xs and min(ys) == 1.25
    assert all(values[s] == y for s, y in zip(xs, ys))  # logged points, not made up
    assert len(find(labels, "train loss, mean").get_xdata()) <= plot_log.MAX_POINTS
    assert f"(last {values[-1]:.4g})" in train.get_label()


def test_numbers_too_large_to_draw_are_one_line(tmp_path):
    """Values near float's limit: the axes' range overflows, fitted to them (--no_zoom) or widened for val points."""
    for text, flags in (("0 train 1e308\n1 train -1e308\n", ["--no_zoom"]), ("0 val 1e308\n1 val -1e308\n", [])):
        path = write(tmp_path / "log.txt", text)
        assert_one_line_error(run_script(["plot_log.py", path, *flags]), "too large to draw")
        assert not os.path.exists(tmp_path / "plot.png")
    with pytest.raises(UserError, match=":1: expected"):  # a step no run reaches
        plot_log.parse_log(write(tmp_path / "steps.txt", f"{2**63} train 3.0\n"))


# -----------------------------------------------------------------------------
# several runs compared


RUNS = {  # three runs of different lengths and kinds: only b has HellaSwag, only c a loss of another name
    "a": "0 val 10.9\n0 train 10.95\n1 train 9.5\n2 train 8.25\n2 val 8.5\n",
    "b": "0 val 10.8\n0 hella 0.25\n0 train 10.9\n1 train 9.0\n2 train nan skipped\n3 train 7.0\n4 val 7.5\n4 hella 0.27\n",
    "c": "0 train 11.0\n1 train 10.0\n1 distill_loss 4.5\n",
}


def independent_parse(text):
    """{kind: ([steps], [values])} of a log, finite values only, a `skipped` line left out: written apart from plot_log."""
    out = {}
    for line in text.splitlines():
        if line.strip() and "skipped" not in line:
            step, kind, value = line.split()
            if math.isfinite(float(value)):
                out.setdefault(kind, ([], []))
                out[kind][0].append(int(step))
                out[kind][1].append(float(value))
    return out


def run_folders(tmp_path, runs=RUNS):
    for name, text in runs.items():
        (tmp_path / name).mkdir()
        write(tmp_path / name / "log.txt", text)
    return [str(tmp_path / name) for name in runs]


def drawn_figure(monkeypatch, argv):
    """main(argv)'s Figure, caught as it is built (before it is saved)."""
    figures = []
    build = plot_log.build_comparison
    monkeypatch.setattr(plot_log, "build_comparison", lambda *a, **kw: figures.append(build(*a, **kw)) or figures[-1])
    out = plot_log.main(argv)
    return out, figures[0]


def test_several_runs_are_drawn_on_the_same_panels_each_as_its_log_says(tmp_path, monkeypatch):
    folders = run_folders(tmp_path)
    out, fig = drawn_figure(monkeypatch, [*folders, "--out", str(tmp_path / "cmp.png")])
    assert out == str(tmp_path / "cmp.png") and (tmp_path / "cmp.png").read_bytes()[:8] == PNG
    drawn = plot_log.plotted(fig)
    assert list(drawn) == ["loss", "HellaSwag"]
    names = {"train": "train loss", "val": "val loss", "hella": "acc_norm", "distill_loss": "distill_loss"}
    colors = {}
    for run, text in RUNS.items():
        for kind, (steps, values) in independent_parse(text).items():
            panel = "HellaSwag" if kind == "hella" else "loss"
            label = f"{run}: {names[kind]} (last {values[-1]:.4g})"
            assert drawn[panel][label] == (steps, values), (run, kind)
            line = next(ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == label)
            colors.setdefault(run, set()).add(line.get_color())
    assert all(len(c) == 1 for c in colors.values()) and len(set.union(*colors.values())) == 3  # a colour a run
    run_lines = [k for panel in drawn.values() for k in panel if k.split(":")[0] in RUNS]
    assert len(run_lines) == sum(len(independent_parse(t)) for t in RUNS.values())  # nothing else of the runs


def test_a_comparison_is_written_as_a_png_from_the_command_line(tmp_path):
    import matplotlib.pyplot as plt

    folders = run_folders(tmp_path)
    r = run_script([os.path.join(ROOT, "plot_log.py"), *folders[:2]], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG  # several logs: compare.png here, no run's plot.png
    assert not (tmp_path / "a" / "plot.png").exists() and plt.imread(str(tmp_path / "compare.png")).shape[0] > 100
    r = run_script([os.path.join(ROOT, "plot_log.py"), *folders, "--out", str(tmp_path / "three.png")])
    assert r.returncode == 0 and (tmp_path / "three.png").read_bytes()[:8] == PNG, r.stderr


def test_x_tokens_uses_each_runs_total_batch_size(tmp_path, monkeypatch):
    """--x tokens: a run's steps times its --total_batch_size, read from its newest checkpoint; a log without a
    checkpoint, or a run whose batch grew, is one line."""
    import torch

    a, b = run_folders(tmp_path, {"a": RUNS["a"], "b": RUNS["b"]})
    for folder, tokens in ((a, 4096), (b, 1024)):
        torch.save({"args": {"total_batch_size": tokens, "batch_size_warmup_tokens": 0}},
                   os.path.join(folder, "model_00004.pt"))
    torch.save({"args": {"total_batch_size": 1}}, os.path.join(a, "model_00001.pt"))  # older: not the one read
    _, fig = drawn_figure(monkeypatch, [a, b, "--x", "tokens", "--out", str(tmp_path / "t.png")])
    drawn = plot_log.plotted(fig)
    assert drawn["loss"]["a: val loss (last 8.5)"] == ([0, 2 * 4096], [10.9, 8.5])
    assert drawn["loss"]["b: train loss (last 7)"] == ([0, 1024, 3 * 1024], [10.9, 9.0, 7.0])
    assert fig.axes[0].get_xlabel() == "tokens"
    os.remove(os.path.join(b, "model_00004.pt"))
    assert_one_line_error(run_script(["plot_log.py", a, b, "--x", "tokens", "--out", str(tmp_path / "u.png")]),
                          f"{b}/log.txt: its log records steps, not tokens", "--x step")
    torch.save({"args": {"total_batch_size": 1024, "batch_size_warmup_tokens": 5000}}, os.path.join(b, "model_00004.pt"))
    with pytest.raises(UserError, match="batch grew over its first 5,000 tokens"):
        plot_log.main([a, b, "--x", "tokens", "--out", str(tmp_path / "u.png")])
    assert not (tmp_path / "u.png").exists()


def test_bad_comparisons_are_one_line(tmp_path):
    folders = run_folders(tmp_path, {"a": RUNS["a"]})
    (tmp_path / "empty").mkdir()
    (tmp_path / "other" / "a").mkdir(parents=True)
    write(tmp_path / "other" / "a" / "log.txt", RUNS["b"])
    out = str(tmp_path / "x.png")
    for logs, needles in (([folders[0], str(tmp_path / "empty")], [f"{tmp_path / 'empty'} holds no run's log.txt"]),
                          ([folders[0], str(tmp_path / "other" / "a")], ["two runs are named a"]),
                          ([folders[0], os.path.join(folders[0], "log.txt")], ["two runs are named a"])):
        assert_one_line_error(run_script(["plot_log.py", *logs, "--out", out]), *needles)
    assert not os.path.exists(out)
