"""
The table bench/gpu_check.sh ends with, read from its logs folder: each stage's exit, seconds and, for a
training run, its summary line's ms/step, tokens/s and peak memory; each resumed run's log against the
straight run's (one run: the same steps, each logged once, each value within its kind's tolerance, exactly
with --exact). Its last line is one of three: "passed" (every row finished and passed),
"FAILED" (exit 1), or "CUT SHORT" (exit 3): a stage was killed at its cap or by a signal, or did not start for want of
time, or (--partial) the call had not ended when this was written, so stages after the last row never reported.
A cut-short or failed call never reads as passed.

    python bench/gpu_check_report.py LOGS_DIR [--exact | --hellaswag_examples N] [--partial]
"""

import argparse
import csv
import os
import re
import sys

# side_by_side.sh's line for each variant: its flags, ms/step and speed against build-nanogpt
SPEED_RE = re.compile(r"ours \[(.*?)\] ([\d.]+) ms/step.*speed vs build-nanogpt ([\d.]+)x")
SIDE_BY_SIDE = ("side_by_side", "levers", "levers_vocab")  # the rows that run side_by_side.sh
SUMMARY_RE = re.compile(r"summary: .*?median ([\d.]+) ms/step.*?\| ([\d,]+) tok/s.*?peak memory ([\d.]+) GiB")
# bf16 kernels on a GPU are not bit-deterministic (atomic adds in the backward): a resumed run's losses may
# differ from the straight run's in the last digits; 1e-3 of a loss near 10 is far above that and far below
# what a wrong data position or optimizer state does (a different batch moves a loss by ~1e-1)
GPU_TOLERANCE = 1e-3
LOSSES = ("train", "skipped", "val")  # log.txt's kinds that are losses (a skipped step's is its non-finite loss)


def read_log(path):
    """[(step, kind, value)] of a log.txt, in order."""
    return [(step, kind, float(value)) for step, kind, value in read_log_text(path)]


def read_log_text(path):
    """[(step, kind, value as written)] of a log.txt, in order."""
    with open(path) as f:
        return [(int(s), k, v) for s, k, v in (line.split()[:3] for line in f if line.strip())]


def gpu_tolerances(straight_path, hellaswag_examples):
    """{kind: tolerance} for a resume on a GPU, each kind's own: a loss may move by GPU_TOLERANCE; HellaSwag's
    acc_norm over N examples moves in steps of 1/N, so one example that flips between the nearly tied endings
    (bf16's last digits decide it) moves it by 1/N (2e-3 at 500 examples: above a loss's 1e-3). Each value is
    written rounded (half a unit of its last decimal either way), so each kind's tolerance adds one unit of the
    last decimal its values are written with in the straight log (train 1e-6, val and hella 1e-4 today)."""
    kinds, unit = set(), {}
    for _, kind, text in read_log_text(straight_path):
        kinds.add(kind)
        if "." in text:  # (not a non-finite loss)
            unit[kind] = max(unit.get(kind, 0.0), 10.0 ** -len(text.partition(".")[2]))
    moves = {kind: GPU_TOLERANCE for kind in LOSSES}
    if hellaswag_examples:
        moves["hella"] = 1 / hellaswag_examples
    return {kind: moves[kind] + unit.get(kind, 0.0) for kind in kinds if kind in moves}


def compare_resume(straight_path, resumed_path, tolerance):
    """'' if the resumed log reads as the straight run (each (step, kind) once, the same entries, values
    within tolerance: one number for every kind, or {kind: number}, where a kind without one differs),
    else what differs."""
    straight, resumed = read_log(straight_path), read_log(resumed_path)
    keys = [(s, k) for s, k, _ in resumed]
    if len(set(keys)) != len(keys):
        return "an entry logged twice"
    if sorted(keys) != sorted((s, k) for s, k, _ in straight):
        return f"entries differ: {len(resumed)} resumed, {len(straight)} straight"
    want = {(s, k): v for s, k, v in straight}
    for kind in sorted({k for _, k, _ in resumed}):
        allowed = tolerance.get(kind) if isinstance(tolerance, dict) else tolerance
        if allowed is None:
            return f"no tolerance for {kind} entries"
        worst = max(abs(v - want[(s, k)]) for s, k, v in resumed if k == kind)
        if not worst <= allowed:  # (a NaN is not)
            return f"max difference of {kind} {worst:.2e} > {allowed:.2g}"
    return ""


def tolerance_note(tolerance):
    """How the resumed log was held to the straight one, for the table's notes."""
    if not isinstance(tolerance, dict):
        return f"within {tolerance:g}"
    return "within " + ", ".join(f"{kind} {value:.2g}" for kind, value in sorted(tolerance.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("logs")
    p.add_argument("--exact", action="store_true", help="resumed logs equal to the straight ones exactly (CPU, fp32)")
    p.add_argument("--hellaswag_examples", type=int, default=0,
                   help="the in-loop HellaSwag's number of examples (its acc_norm moves in steps of 1/N)")
    p.add_argument("--partial", action="store_true", help="written while the call runs: CUT SHORT unless it goes on")
    args = p.parse_args(argv)
    env = os.path.join(args.logs, "env.txt")
    if os.path.exists(env):
        print(open(env).read().strip())
    failed, cut = False, args.partial
    print(f"{'stage':<22} {'result':<18} {'s':>5} {'ms/step':>9} {'tok/s':>10} {'peak GiB':>9}  notes")
    rows, runs = [], os.path.join(args.logs, "runs.tsv")
    if os.path.exists(runs):  # (else the call was stopped before it began)
        with open(runs) as f:
            rows = list(csv.reader(f, delimiter="\t"))
    for name, rc, seconds in rows:
        numbers, notes = ("", "", ""), ""
        log = os.path.join(args.logs, f"{name}.txt")
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        if rc.isdigit():
            result = "ok" if rc == "0" else f"FAILED (exit {rc})"
            failed |= rc != "0"
        elif rc.startswith(("cut short", "not run")):  # killed at its cap or by a signal; no time left to start
            result, notes, cut = "CUT SHORT", rc, True
        else:
            result = rc  # "skipped: no CUDA", "no checkpoint from default"
            failed |= not rc.startswith("skipped")
        m = SUMMARY_RE.search(text)
        if m:
            numbers = m.groups()
        straight = os.path.join(args.logs, f"{name}.straight_log.txt")
        if os.path.exists(straight) and rc == "0":
            tolerance = 0.0 if args.exact else gpu_tolerances(straight, args.hellaswag_examples)
            problem = compare_resume(straight, os.path.join(args.logs, f"{name}.resumed_log.txt"), tolerance)
            notes = problem or f"log reads as one run ({tolerance_note(tolerance)})"
            if problem:
                result, failed = "FAILED (resume)", True
        if name == "tests":
            tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
            notes = tail[-1] if tail else ""
        if name == "sampling_speed" and rc == "0":  # bench_generate.py's table: its last row, tokens/s and "same tokens"
            table = [line.strip() for line in text.splitlines() if line.startswith("| ")]
            notes = "tok/s " + table[-1] if table else "no table"
            if not table or not table[-1].endswith("| yes |"):
                result, failed = "FAILED (tokens)", True
        if name in SIDE_BY_SIDE and rc == "0":  # each program's "rc=N" line, then each variant against build-nanogpt
            speeds = SPEED_RE.findall(text)
            shared = os.path.commonprefix([flags.split() for flags, _, _ in speeds]) if len(speeds) > 1 else []
            notes = "; ".join(f"[{' '.join(flags.split()[len(shared):]) or 'defaults'}] {ratio}x"
                              for flags, _, ratio in speeds) + " vs build-nanogpt" if speeds else "no speed ratio"
            numbers = (speeds[0][1] if speeds else "", "", "")
            if not speeds or re.search(r"rc=[1-9]", text):
                result, failed = "FAILED (programs)", True
        print(f"{name:<22} {result:<18} {seconds:>5} {numbers[0]:>9} {numbers[1]:>10} {numbers[2]:>9}  {notes}")
    if cut:
        print("gpu check: CUT SHORT: the call ended before its stages did; only the rows above finished"
              + (" (and some of them FAILED)" if failed else ""))
        return 3
    print("gpu check: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
