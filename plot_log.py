"""
Plot a training run's log.txt: train/val loss and HellaSwag accuracy against GPT-2 / GPT-3 124M.

    python plot_log.py log/log.txt                  # writes log/plot.png
    python plot_log.py log --out run1.png           # a log folder works too

log.txt is what train_gpt2.py writes, build-nanogpt's format: one `<step> <kind> <value>` per line,
kind train / val / hella (a train line may end in `skipped`: a non-finite step that was not applied).
Left panel: losses, with OpenAI GPT-2 124M's FineWeb-Edu val loss for reference; once the run is
below 4.0 the y-axis shows 2.8-4.0 (as build-nanogpt's play.ipynb does), else it fits the data.
Right panel: HellaSwag acc_norm, with GPT-2 124M's and GPT-3 124M's.
"""

import math
import os

from common import CLIParser, UserError, atomic_write, run_cli

GPT2_124M_VAL_LOSS = 3.2924  # OpenAI GPT-2 124M on FineWeb-Edu val (build-nanogpt's baseline line)
GPT2_124M_HELLASWAG = 0.2945  # acc_norm, as the training loop measures it
GPT3_124M_HELLASWAG = 0.337  # GPT-3 paper, the "small" model
KINDS = ("train", "val", "hella")


def parse_log(path):
    """{kind: (steps, values)} sorted by step, for each kind seen. A step logged twice (a run resumed
    without trimming) keeps its last value. A malformed line raises UserError naming it."""
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist; give a run's log.txt (train_gpt2.py writes it into --log_dir)")
    series = {}
    with open(path, encoding="utf-8", errors="replace") as f:  # a binary file fails below, naming its first line
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            ok = len(parts) == 3 or (len(parts) == 4 and parts[1] == "train" and parts[3] == "skipped")
            try:
                step, kind, value = int(parts[0]), parts[1], float(parts[2])
            except (ValueError, IndexError):
                ok = False
            if not ok or step < 0 or kind not in KINDS:
                raise UserError(f"{path}:{lineno}: expected '<step> train|val|hella <value>', found {line.strip()[:80]!r}")
            series.setdefault(kind, {})[step] = value
    if not series:
        raise UserError(f"{path} holds no log lines yet")
    return {kind: (sorted(d), [d[s] for s in sorted(d)]) for kind, d in series.items()}


def finite(steps, values):
    """Drop non-finite points (a skipped step logs nan or inf)."""
    kept = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def plot(series, out, title=None):
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_hella) = plt.subplots(1, 2, figsize=(16, 6))
    losses = []
    for kind, style in (("train", dict(lw=0.8, alpha=0.8)), ("val", dict(lw=1.5, marker="."))):
        if kind in series:
            steps, values = finite(*series[kind])
            ax_loss.plot(steps, values, label=f"{kind} loss" + (f" (last {values[-1]:.4f})" if values else ""), **style)
            losses += values
    ax_loss.axhline(GPT2_124M_VAL_LOSS, color="r", ls="--", lw=1, label=f"OpenAI GPT-2 (124M) val loss {GPT2_124M_VAL_LOSS}")
    if losses and min(losses) < 4.0:  # past the start: zoom into the range where runs are compared
        ax_loss.set_ylim(min(2.8, min(losses) - 0.05), 4.0)
    elif losses:
        lo, hi = min(losses + [GPT2_124M_VAL_LOSS]), max(losses)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo) - 0.01, hi + 0.05 * (hi - lo) + 0.01)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    if "hella" in series:
        steps, values = finite(*series["hella"])
        ax_hella.plot(steps, values, marker=".", label=f"this run (last {values[-1]:.4f})" if values else "this run")
    else:
        ax_hella.text(0.5, 0.5, "no HellaSwag lines in the log", ha="center", va="center", transform=ax_hella.transAxes)
    ax_hella.axhline(GPT2_124M_HELLASWAG, color="r", ls="--", lw=1, label=f"OpenAI GPT-2 (124M) {GPT2_124M_HELLASWAG}")
    ax_hella.axhline(GPT3_124M_HELLASWAG, color="g", ls="--", lw=1, label=f"OpenAI GPT-3 (124M) {GPT3_124M_HELLASWAG}")
    ax_hella.set_xlabel("step")
    ax_hella.set_ylabel("acc_norm")
    ax_hella.set_title("HellaSwag")
    ax_hella.legend()
    ax_hella.grid(alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_write(out) as f:  # an existing plot is replaced only by a complete one
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def main(argv=None):
    p = CLIParser(description="Plot loss and HellaSwag curves of a train_gpt2.py run's log.txt as one PNG.")
    p.add_argument("log", help="log.txt of a run, or its log folder")
    p.add_argument("--out", default=None, help="PNG to write (default: plot.png beside the log)")
    args = p.parse_args(argv)
    path = os.path.join(args.log, "log.txt") if os.path.isdir(args.log) else args.log
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(path)), "plot.png")
    series = parse_log(path)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed; set here so importing this module changes nothing
    try:
        plot(series, out, title=path)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}); pick another --out") from None
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
