"""
Plot a training run's log.txt as one PNG: losses, HellaSwag, CORE, and every other logged number.

    python plot_log.py log/log.txt                  # writes log/plot.png
    python plot_log.py log --out run1.png           # a log folder works too
    python plot_log.py log --smooth 50              # + a 50-step moving average of the train loss
    python plot_log.py log --no_zoom                # the loss axis fits every train and val point
    python plot_log.py log/a log/b log/c            # runs compared: ./compare.png, one colour a run
    python plot_log.py log/a log/b --x tokens       # aligned by tokens trained on instead of by step
    python plot_log.py log/a log/b --x time         # aligned by the time spent in training steps

log.txt is what train_gpt2.py writes, build-nanogpt's format: one `<step> <kind> <value>` per line,
where kind is any word. `<step> skipped <loss>` marks a non-finite step that was not applied: it is not
plotted (older logs wrote it as `<step> train <loss> skipped`, read the same way).
A new evaluation logged as e.g. `<step> mmlu 0.31` needs no change here. Panels, one per group:
- losses: `train`, `val` and every kind ending in `loss`, with OpenAI GPT-2 124M's FineWeb-Edu val loss as a
  reference where the log says its validation text is FineWeb-Edu's (its `val_fineweb_edu` line, which train_gpt2.py
  writes from the shards' manifest.json; a log without that line, from before it was written, gets no reference line
  and a note saying why); once the run has come down through 4.0 the y-axis zooms to 2.8-4.0 (build-nanogpt's
  play.ipynb tops it at 4.0), cropping only the train loss: it is widened to keep every val point (and every point of
  the other losses) in view; else, or with --no_zoom, it fits every point; --smooth K adds a moving average;
- HellaSwag (only when the log has `hella` lines): acc_norm, its 0.25 chance line, GPT-2 124M's and
  GPT-3 124M's numbers;
- CORE (only when the log has `core` lines): the score, with GPT-2 124M's and 350M's (nanochat's evaluation);
- every other kind (`lr`, `mmlu`, ...) on a panel of its own.
A kind with no finite value (a run that diverged at once logs only nan) is left out; a log with
nothing finite to plot is refused.
A line of more than MAX_POINTS points is drawn from the lowest and highest of each run of consecutive
points (a panel has far fewer pixels; Agg cannot draw millions), so spikes still show.
A reference line is drawn only where it lies inside the panel's y-range, which the run's values (and the
zoom) set and the line never widens, so a short run's curves are not squashed by it.

The lines that describe a run rather than a curve (nanogpt/log_kinds.py: `params`, `step_ms`, `val_fineweb_edu`) are
not drawn: a run's parameters and median time per step (after its first steps, as the run's summary line takes it)
follow its first legend label on each panel.

Several logs are drawn on the same panels, one colour a run, each line's legend naming the run (its log folder's
name) and its last value; --x time puts the time each run spent in training steps before each step on the x-axis
(the sum of its logged step times: evaluations, checkpoints and the pause between a stop and a resume are not in it;
a log without step times, written before they were logged, is refused in one line); --x tokens puts the tokens
trained on before each step there (step x the run's --total_batch_size, read from the newest checkpoint beside its
log, which needs torch; a log without one, or a run whose batch grew with --batch_size_warmup_tokens, is refused in one
line).

--out must end in .png and be a new file or an existing PNG (or a FIFO or character device, written in place):
the log itself, or any other existing file that is not a PNG, is refused, so a slip of the command line cannot
destroy a log. This module does not import torch, except to read a checkpoint's --total_batch_size for --x tokens.
"""

import functools
import itertools
import math
import os
import re
import statistics
import warnings

from nanogpt.cli import CLIParser, UserError, run_cli
from nanogpt.files import check_output_file, output_file, written_in_place
from nanogpt.log_kinds import PARAMS, RUN_KINDS, STEP_MS, VAL_FINEWEB_EDU, timed_steps

GPT2_124M_VAL_LOSS = 3.2924  # OpenAI GPT-2 124M on FineWeb-Edu val (build-nanogpt's baseline line)
GPT2_124M_HELLASWAG = 0.2945  # acc_norm, as the training loop measures it
GPT3_124M_HELLASWAG = 0.337  # GPT-3 paper, the "small" model
HELLASWAG_CHANCE = 0.25  # four endings
GPT2_CORE = (("124M", 0.1139), ("350M", 0.1849))  # OpenAI GPT-2's CORE as nanochat scores it (evaluate.py's protocol)
ZOOM = (2.8, 4.0)  # loss range where runs are compared: build-nanogpt's play.ipynb tops it at 4.0; GPT-2's line shows
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KIND_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")  # a word: what a log line's second field may be
LOSS_PANEL, HELLA_PANEL, CORE_PANEL = "loss", "HellaSwag", "CORE"
COMPARISON = "compare.png"  # --out's default for several logs
MAX_POINTS = 10_000  # per line drawn: a panel is ~700 pixels wide; millions of points overflow Agg's path limit


def parse_log(path):
    """{kind: (steps, values)} sorted by step, for each kind seen, in order of first appearance. A step
    logged twice (a run resumed without trimming) keeps its last value. A last line without its newline is one
    the run is still writing: left out. A malformed line raises UserError naming it."""
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist; give a run's log.txt (train_gpt2.py writes it into --log_dir)")
    series = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # a binary file fails below, naming its first line
            for lineno, line in enumerate(f, 1):
                if not line.endswith("\n"):  # the last line, without its newline: still being written
                    break
                parts = line.split()
                if not parts:
                    continue
                ok = len(parts) == 3 or (len(parts) == 4 and parts[1] == "train" and parts[3] == "skipped")
                try:
                    step, kind, value = int(parts[0]), parts[1], float(parts[2])
                except (ValueError, IndexError):
                    ok = False
                if not ok or not 0 <= step < 2**63 or not KIND_RE.match(kind):
                    raise UserError(f"{path}:{lineno}: expected '<step> <kind> <value>' (e.g. '250 val 3.41'), "
                                    f"found {line.strip()[:80]!r}")
                series.setdefault("skipped" if len(parts) == 4 else kind, {})[step] = value
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
    if not series:
        raise UserError(f"{path} holds no log lines yet")
    return {kind: (sorted(d), [d[s] for s in sorted(d)]) for kind, d in series.items()}


def finite(steps, values):
    """Drop non-finite points (a skipped step logs nan or inf)."""
    kept = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def moving_average(values, k):
    """Trailing mean of the last k values at each point (fewer at the start, where fewer exist)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def thinned(steps, values, max_points=MAX_POINTS):
    """At most max_points of a long line: the lowest and the highest value of each of max_points/2 runs of
    consecutive points, in step order, so spikes and the envelope stay as drawn at full length."""
    if len(steps) <= max_points:
        return steps, values
    buckets = max_points // 2
    out = []
    for b in range(buckets):
        lo, hi = b * len(steps) // buckets, (b + 1) * len(steps) // buckets
        low = min(range(lo, hi), key=values.__getitem__)
        high = max(range(lo, hi), key=values.__getitem__)
        out += sorted({low, high})
    return [steps[i] for i in out], [values[i] for i in out]


def is_loss(kind):
    return kind in ("train", "val") or kind.endswith("loss")


def panels(series):
    """[(panel title, [kinds])]: the losses, HellaSwag, CORE, then each other kind, leaving out kinds without a
    finite value (a run that diverged at once logs only nan) and the groups left empty."""
    kinds = [k for k in series if k != "skipped" and k not in RUN_KINDS and finite(*series[k])[0]]
    losses = [k for k in kinds if is_loss(k)]
    out = [(LOSS_PANEL, losses)] if losses else []
    for kind, panel in (("hella", HELLA_PANEL), ("core", CORE_PANEL)):
        if kind in kinds:
            out.append((panel, [kind]))
    out += [(k, [k]) for k in kinds if not is_loss(k) and k not in ("hella", "core")]
    return out


def loss_range(ax, lines):
    """The loss panel zoomed to ZOOM once the runs have come down through its top, cropping only the train loss
    (and its mean): the range is widened to hold every point of the other losses (val, ...) with a 5% margin.
    lines: [(kind, finite values)] of every run on the panel."""
    points = [v for _, values in lines for v in values]
    evals = [v for kind, values in lines if kind != "train" for v in values]
    (bottom, top), lowest = ZOOM, min(points)
    if not lowest < top < max(points):
        return
    bottom = min(bottom, lowest - 0.05)
    if evals and max(evals) > top:
        top = max(evals) + 0.05 * (max(evals) - bottom)
    ax.set_ylim(bottom, top)


def reference_lines(ax, lines):
    """Each (y, color, label) that lies inside the panel's y-range, drawn as a dashed line: the range is the
    data's (or the zoom's), and a line outside it would widen it, squashing the run's curves."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi)  # frozen: axhline takes part in autoscaling
    for y, color, label in lines:
        if lo <= y <= hi:
            ax.axhline(y, color=color, ls="--", lw=1, label=label)


def run_facts(series):
    """'7.3M parameters, 1,950 ms/step' of a run's log (its `params` line; the median of its `step_ms` lines after
    the first steps, as the run's summary line takes it), or the part of it the log holds ('' for neither)."""
    facts = []
    if PARAMS in series:
        n = series[PARAMS][1][-1]
        facts.append(f"{n / 1e9:.2f}B parameters" if n >= 1e9 else f"{n / 1e6:.1f}M parameters" if n >= 1e5
                     else f"{n:,.0f} parameters")
    if STEP_MS in series:
        facts.append(f"{statistics.median(timed_steps(series[STEP_MS][1])):,.0f} ms/step")
    return ", ".join(facts)


def on_fineweb_edu(series):
    """True or False as the log says whether its validation text is FineWeb-Edu's (the `val_fineweb_edu` line
    train_gpt2.py writes from the shards' manifest.json); None for a log that does not say (written before it did)."""
    return bool(series[VAL_FINEWEB_EDU][1][-1]) if VAL_FINEWEB_EDU in series else None


def label_of(kind, values):
    name = {"train": "train loss", "val": "val loss", "hella": "acc_norm", "core": "CORE"}.get(kind, kind)
    return name + (f" (last {values[-1]:.4g})" if values else "")


def build_figure(series, title=None, smooth=0, zoom=True):
    """The plot of one run's parsed log series as a matplotlib Figure (not shown, not saved; no pyplot state). zoom:
    the loss panel's (loss_range); else it fits every point."""
    return build_comparison([(None, series, None)], title=title, smooth=smooth, zoom=zoom)


def build_comparison(runs, title=None, smooth=0, zoom=True, x_label="step"):
    """The plot of several runs on the same panels as a Figure: runs is [(name, series, to_x)]; each run has a colour
    of its own and its name first in each of its legend labels (one run named None: the single-log plot, in
    matplotlib's colours), and its parameters and time per step (run_facts) after its first label on each panel.
    to_x None: x is the step; else to_x(steps) is the x of each (the tokens or the time before it), x_label says what.
    A panel is drawn when any run has its kinds; FineWeb-Edu's reference loss where a run's log says its validation
    text is FineWeb-Edu's."""
    from matplotlib.figure import Figure

    groups = {}
    for _, series, _ in runs:
        for name, kinds in panels(series):
            groups.setdefault(name, [])
            groups[name] += [k for k in kinds if k not in groups[name]]
    if not groups:
        raise UserError("the log holds no finite values to plot")
    cols = min(len(groups), 3)
    rows = -(-len(groups) // cols)
    fig = Figure(figsize=(7 * cols, 5 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(groups):]:
        fig.delaxes(ax)
    fineweb_edu = [run for run, series, _ in runs if on_fineweb_edu(series)]
    for ax, (name, kinds) in zip(axes, groups.items()):
        drawn = []
        for i, (run, series, to_x) in enumerate(runs):
            color = {} if run is None else {"color": f"C{i % 10}"}
            prefix, facts = "" if run is None else f"{run}: ", run_facts(series)
            for kind in kinds:
                if kind not in series:
                    continue
                steps, values = finite(*series[kind])
                if not steps:
                    continue
                label = prefix + label_of(kind, values) + (f" | {facts}" if facts else "")
                facts = ""  # once a run and panel
                drawn.append((kind, values))
                if name == LOSS_PANEL and kind == "train":
                    style = dict(lw=0.8, alpha=0.4 if smooth > 1 else 0.8)
                elif len(steps) > 30:
                    style = dict(lw=1.2)
                else:
                    style = dict(lw=1.5, marker=".")
                if run is not None and name == LOSS_PANEL and kind not in ("train", "val"):
                    style["ls"] = "--"
                ax.plot(*x_of(thinned(steps, values), to_x), label=label, **style, **color)
                if name == LOSS_PANEL and kind == "train" and smooth > 1 and values:
                    avg = moving_average(values, smooth)
                    ax.plot(*x_of(thinned(steps, avg), to_x), lw=1.5, color=ax.lines[-1].get_color(),
                            label=f"{prefix}train loss, mean of last {min(smooth, len(values))} (last {avg[-1]:.4g})")
        if name == LOSS_PANEL:
            if zoom:
                loss_range(ax, drawn)
            whose = "" if len(fineweb_edu) == len(runs) else f" (FineWeb-Edu val: {', '.join(fineweb_edu)})"
            reference_lines(ax, [(GPT2_124M_VAL_LOSS, "r", f"OpenAI GPT-2 (124M) val loss {GPT2_124M_VAL_LOSS}{whose}")]
                            if fineweb_edu else [])
            ax.set_ylabel("loss")
        elif name == HELLA_PANEL:
            ax.axhline(HELLASWAG_CHANCE, color="gray", ls=":", lw=1, label=f"chance {HELLASWAG_CHANCE}")
            reference_lines(ax, [(ref, color, f"OpenAI {who} (124M) {ref}") for ref, color, who in
                                 ((GPT2_124M_HELLASWAG, "r", "GPT-2"), (GPT3_124M_HELLASWAG, "g", "GPT-3"))])
            ax.set_ylabel("acc_norm")
        elif name == CORE_PANEL:
            reference_lines(ax, [(ref, color, f"OpenAI GPT-2 ({size}) {ref}")
                                 for (size, ref), color in zip(GPT2_CORE, ("r", "m"))])
            ax.set_ylabel("CORE (mean centered accuracy)")
        else:
            ax.set_ylabel(name)
        ax.set_title(name)
        ax.set_xlabel(x_label)
        ax.legend()
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def x_of(points, to_x):
    """(x, values) of (steps, values): the steps, or to_x(steps) (the tokens or the time before each)."""
    steps, values = points
    return (steps if to_x is None else to_x(steps)), values


def plotted(fig):
    """{panel title: {line label: (x, y)}}: what a Figure draws, read back from its lines (reference lines too)."""
    return {ax.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
            for ax in fig.axes}


def tokens_per_step(path):
    """Tokens trained on per step by the run whose log is path: its --total_batch_size, read from the newest
    checkpoint beside the log (log.txt itself holds steps only). UserError when there is none, or when the batch
    grew over the run (--batch_size_warmup_tokens), so that its steps are not of equal tokens."""
    folder = os.path.dirname(os.path.abspath(path))
    from nanogpt.checkpoints import find_checkpoints  # torch: only for --x tokens

    found = find_checkpoints(folder)
    if not found:
        raise UserError(f"{path}: its log records steps, not tokens, and no model_<step>.pt beside it gives the run's "
                        "--total_batch_size; plot it with --x step")
    import torch

    try:
        args = torch.load(found[0], map_location="cpu", weights_only=True, mmap=True).get("args") or {}
    except Exception as e:  # noqa: BLE001 (any unreadable checkpoint is the same answer)
        raise UserError(f"{found[0]}: cannot read the run's --total_batch_size from it ({type(e).__name__}); "
                        "plot with --x step") from None
    if not isinstance(args.get("total_batch_size"), int):
        raise UserError(f"{found[0]} holds no --total_batch_size; plot with --x step")
    if args.get("batch_size_warmup_tokens"):
        raise UserError(f"{path}: the run's batch grew over its first {args['batch_size_warmup_tokens']:,} tokens "
                        "(--batch_size_warmup_tokens), so its steps are not of equal tokens; plot it with --x step")
    return args["total_batch_size"]


def seconds_before(path, series):
    """[the seconds the run spent in training steps before step s, for s from 0 to one past its last step], summed
    from its log's step_ms lines. A UserError where the log lacks the time of a step it trained (a log written before
    they were logged, or a run resumed from one)."""
    trained = sorted({*series.get("train", ((),))[0], *series.get("skipped", ((),))[0]})
    times = dict(zip(*series.get(STEP_MS, ((), ()))))
    untimed = [step for step in range(trained[-1] + 1 if trained else 0) if step not in times]
    if not trained or untimed:
        where = f"step {untimed[0]}" if untimed else "any step"
        raise UserError(f"{path}: its log holds no time for {where} (the step_ms lines of a newer train_gpt2.py); "
                        "plot it with --x step or --x tokens")
    return [0.0, *itertools.accumulate(times[step] / 1000 for step in range(trained[-1] + 1))]


TIME_UNITS = ((3 * 3600, 3600, "hours"), (3 * 60, 60, "minutes"), (0, 1, "seconds"))  # the first whose floor is passed


def time_axis(elapsed_of_runs):
    """(x label, [to_x of each run]) for --x time: each run's seconds before each step, in the unit that suits the
    longest run."""
    longest = max(elapsed[-1] for elapsed in elapsed_of_runs)
    _, unit, name = next(entry for entry in TIME_UNITS if longest >= entry[0])
    to_x = [lambda steps, e=elapsed: [e[min(s, len(e) - 1)] / unit for s in steps] for elapsed in elapsed_of_runs]
    return f"time in training steps ({name})", to_x


def scaled(factor, steps):
    return [s * factor for s in steps]


def check_out(out, log_path):
    """Refuse an --out whose writing would destroy something: the log itself, a folder, a file that is
    not a PNG (a PNG is a plot from an earlier run: replacing it is the point); and a name that does not
    end in .png (the plot is one); and whatever files.check_output_file refuses. A missing file is fine when its
    folder exists; a FIFO or a character device is written in place."""
    if os.path.isdir(out):
        raise UserError(f"--out {out} is a folder; give a file name such as {os.path.join(out, 'plot.png')}")
    if os.path.exists(out) and os.path.exists(log_path) and os.path.samefile(out, log_path):
        raise UserError(f"--out {out} is the log being plotted; give another file, e.g. plot.png beside it")
    if not out.lower().endswith(".png"):
        raise UserError(f"--out {out}: the plot is a PNG; give a file name ending in .png")
    check_output_file(out, "--out")
    if os.path.exists(out) and not written_in_place(out):  # a FIFO's head is its reader's, never ours to read
        try:
            with open(out, "rb") as f:
                head = f.read(len(PNG_SIGNATURE))
        except OSError as e:
            raise UserError(f"--out {out} exists and cannot be read ({e.strerror or e}); give another file") from None
        if head != PNG_SIGNATURE:
            raise UserError(f"--out {out} exists and is not a PNG; refusing to overwrite it, give another file")


def build_parser():
    p = CLIParser(description="Plot the curves of a train_gpt2.py run's log.txt (losses, HellaSwag, CORE, any other "
                              "logged kind) as one PNG.")
    p.add_argument("log", nargs="+",
                   help="log.txt of a run, or its log folder; several runs (each named by its folder) are compared "
                        "on the same panels, one colour a run")
    p.add_argument("--out", default=None,
                   help="PNG to write, ending in .png: a new file or an existing PNG, never a log "
                        f"(default: plot.png beside the log; {COMPARISON} in the current folder for several logs)")
    p.add_argument("--x", default="step", choices=["step", "tokens", "time"],
                   help="the x-axis: the step; the tokens trained on before it (step x the run's --total_batch_size, "
                        "from the newest checkpoint beside its log); or the time the run spent in training steps "
                        "before it (the sum of its log's step times: evaluations, checkpoints and pauses left out)")
    p.add_argument("--smooth", type=int, default=0, metavar="K",
                   help="also draw the mean of the last K train-loss points at each step over the raw curve "
                        "(0 or 1 = off)")
    p.add_argument("--no_zoom", dest="zoom", action="store_false",
                   help=f"the loss panel's y-axis covers every train and val point; without it, once the run has "
                        f"come down through {ZOOM[1]} the axis shows {ZOOM[0]}-{ZOOM[1]}, widened to keep every val "
                        "point in view")
    return p


def log_paths(logs):
    """[(run name, log.txt path)] of the logs given (a file, or a folder holding log.txt); a run is named by its log's
    folder. A folder without log.txt, or two runs of the same name, is a UserError."""
    runs = []
    for log in logs:
        path = os.path.join(log, "log.txt") if os.path.isdir(log) else log
        if os.path.isdir(log) and not os.path.isfile(path):
            raise UserError(f"{path} does not exist: {log} holds no run's log.txt (train_gpt2.py writes it into "
                            "--log_dir); give a run's log folder")
        runs.append((os.path.basename(os.path.dirname(os.path.abspath(path))) or path, path))
    names = [name for name, _ in runs]
    for name, path in runs:
        if names.count(name) > 1:
            same = [p for n, p in runs if n == name]
            raise UserError(f"two runs are named {name} ({same[0]} and {same[1]}): a run is named by its log's folder, "
                            "so give each log once, from folders of different names")
    return runs


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.smooth < 0:
        raise UserError(f"--smooth {args.smooth}: must be 0 (off) or a window of K >= 2 points")
    runs = log_paths(args.log)
    if args.out is not None:
        out = args.out
    elif len(runs) == 1:
        out = os.path.join(os.path.dirname(os.path.abspath(runs[0][1])), "plot.png")
    else:
        out = COMPARISON
    if not out:
        raise UserError("--out is empty; give a PNG file name")
    for _, path in runs:
        check_out(out, path)
    parsed, elapsed = [], []  # elapsed (--x time): each run's seconds before each step, made an x below
    for name, path in runs:
        series = parse_log(path)
        if not panels(series) and set(series) <= set(RUN_KINDS):  # a run just started: its first lines only
            raise UserError(f"{path} holds no loss yet (only the lines that describe the run); plot it once the run "
                            "has logged a step")
        if not panels(series):
            raise UserError(f"{path} holds no finite values to plot (every value is nan or inf, or a skipped step); "
                            "there is nothing to draw until the run logs a finite one")
        to_x = functools.partial(scaled, tokens_per_step(path)) if args.x == "tokens" else None
        if args.x == "time":
            elapsed.append(seconds_before(path, series))
        if on_fineweb_edu(series) is None and any(map(is_loss, series)):
            print(f"note: {path} does not say whether its validation text is FineWeb-Edu's (a log of an older "
                  f"train_gpt2.py), so OpenAI GPT-2's FineWeb-Edu val loss ({GPT2_124M_VAL_LOSS}) is not drawn for it")
        parsed.append((name if len(runs) > 1 else None, series, to_x))
    x_label = args.x
    if args.x == "time":  # in one unit for every run: the one that suits the longest
        x_label, to_xs = time_axis(elapsed)
        parsed = [(name, series, to_x) for (name, series, _), to_x in zip(parsed, to_xs)]
    title = runs[0][1] if len(runs) == 1 else None
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings, before the error below
            warnings.simplefilter("ignore", RuntimeWarning)
            fig = build_comparison(parsed, title=title, smooth=args.smooth, zoom=args.zoom, x_label=x_label)
            # an existing plot is replaced only by a complete one; through a link, the PNG it points to is
            with output_file(out, "wb") as f:
                fig.savefig(f, format="png", dpi=100)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}); pick another --out") from None
    except (ArithmeticError, ValueError) as e:  # values near float's limit (1e308): the axes cannot scale
        whose = f"{runs[0][1]}: its" if len(runs) == 1 else f"{', '.join(path for _, path in runs)}: their"
        raise UserError(f"{whose} values are too large to draw ({type(e).__name__}: {e})") from None
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
