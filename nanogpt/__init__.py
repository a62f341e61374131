"""
The plumbing of train_gpt2.py and its sibling scripts, a module per concern (docs/layout.md):

    cli              one-line user errors, the command-line runner and parser, the flags scripts share
    files            atomic writes, temporaries, checksums
    tokenizer        the GPT-2 tokenizer (offline), decoding samples             (no torch)
    shards           the token shard format, the data folder's manifest checks  (no torch)
    text_inputs      fineweb.py's readers: local files, the hub stream           (no torch)
    shard_manifest   fineweb.py's manifest.json: what it records, resume checks  (no torch)
    train_val_split  --val_tokens' rate, quota and draw (Router); the split's report (no torch)
    hub_shards       fineweb.py --download of ready-made shards                  (no torch)
    layers           the model's layers beyond GPT-2's: attention over a KV cache, RMSNorm, rotary, llama's, ReLU²
    loss_head        the chunked linear + cross-entropy loss head
    muon             Muon: torch.optim.Muon's update, batched over same-shape matrices, shared across DDP ranks
    optimizers       the parameters by role, the table of the matrices' optimizers (AdamW, Muon), stepped as one
    config_fields    GPTConfig's fields as flags, in checkpoints, held on resume, --init_from and export (no torch)
    hf               transformers GPT-2, Llama, Qwen3: importing their weights, exporting ours
    checkpoints      checkpoint files: find, save, load, prune, resume
    sharding         ZeRO-1 and FSDP2, and gathering their state into one checkpoint
    runtime          device, precision, torch.compile, signals, the ranks' agreement
    arguments        checks of train_gpt2.py's and fineweb.py's arguments before any work
    evaluation       what HellaSwag and CORE share: data downloaded once, read by line, shared from rank 0;
                     rows scored in padded batches (summed loss, greedy match); their command lines' run
    hellaswag_eval   HellaSwag: the val split, rendering, batched scoring; the training loop's (hellaswag.py's CLI)
    core_eval        CORE: DCLM's eval bundle, nanochat's rendering, scoring; the loop's --core_every (evaluate.py)
    loop_evals       the training loop's validation loss and samples
    runlog           log.txt, the log folder's lock, TensorBoard/W&B, the step and summary lines
    run              the training loop's bookkeeping: logging, checkpoints and agreement at their cadence

It never imports train_gpt2.py or any other script.
"""
