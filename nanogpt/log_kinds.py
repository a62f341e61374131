"""
The lines of log.txt that describe a run rather than draw a curve of it, beside build-nanogpt's
`<step> train|val|hella <value>` and in their format (a notebook reading every line as `<step> <kind> <value>`
reads these too): train_gpt2.py writes them, plot_log.py reads them, so that a plot needs neither torch nor a
checkpoint nor the data folder.
- `<step> step_ms <ms>`: the time of each training step, as the step line's `dt` (evaluations, checkpoints and
  the time between a stop and a resume are not in it);
- `0 params <n>`: the model's parameters (the run header's count), once, when a run starts fresh;
- `0 val_fineweb_edu <1 or 0>`: 1 where the shards' manifest.json says they were made from FineWeb-Edu (the text
  OpenAI GPT-2's reference validation loss was measured on), 0 where it says another source or there is none.
Logs written before these lines existed lack them: plot_log.py says what it cannot tell.
Imports no torch.
"""

STEP_MS, PARAMS, VAL_FINEWEB_EDU = "step_ms", "params", "val_fineweb_edu"
RUN_KINDS = (STEP_MS, PARAMS, VAL_FINEWEB_EDU)


def timed_steps(step_times):
    """The step times that say what a step costs: the first fifth of them (at most 10), which compile and fill
    caches, left out; all of them where that would leave none."""
    return step_times[min(len(step_times) // 5, 10):] or step_times
