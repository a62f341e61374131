"""--arch speedrun and --recipe speedrun (docs/recipes.md): the trunk against a second implementation written out
here, the softcapped head and its chunked loss against F.cross_entropy, the key/value cache against recomputing,
each switch of the config, the optimizer's groups and Muon's momentum warm-up, and a run that resumes exactly,
recomputes alike, trains in 2 processes like 1, samples, scores HellaSwag and refuses export in one line.

    python -m pytest -q tests/test_speedrun.py
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

import generate_tokens
import hellaswag
import train_gpt2
from conftest import (assert_cli_error, assert_refused_before_any_work, assert_two_processes_train_like_one,
                      copy_of_run, moved_from_init, numbers_logged, random_tokens, read_log, script_cli,
                      straight_and_resumed, write_hellaswag)
from nanogpt.checkpoints import find_checkpoints, load_checkpoint
from nanogpt.loss_head import chunked_cross_entropy
from nanogpt.optimizers import OptimizerSettings
from nanogpt.tokenizer import GPT2_VOCAB_SIZE

# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = pytest.mark.xdist_group("test_speedrun")

SPEEDRUN = ["--recipe", "speedrun", "--n_layer", "4", "--n_head", "2", "--warmup_steps", "2",
            "--muon_momentum_warmup", "3"]  # TINY_FLAGS' 32 wide, 4 layers: two skips, two value embeddings


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def speedrun_model(seed=0, n_layer=5, **overrides):
    """A speedrun GPT in eval mode, in fp64, its weights (zero-initialised projections, lambdas, skip weights,
    gates included) moved far from their initial values so that every piece shows in the logits."""
    torch.manual_seed(seed)
    config = train_gpt2.GPTConfig(block_size=32, n_layer=n_layer, n_head=4, n_embd=32, n_kv_head=2, arch="speedrun",
                                  **overrides)
    return moved_from_init(train_gpt2.make_gpt(config).double(), 0.1)


def tokens(rows=2, n=20, seed=0):
    return random_tokens(rows, n, seed)


def reference_hidden_states(model, idx):
    """The trunk written out from the paper descriptions, independently of SpeedrunGPT.hidden_states: x0 the RMS-
    normed embedding; before layer i, x <- a_i x + b_i x0; layer j of the second half gets w_j times the output of
    its mirror in the first half (layer n-1-j) added first; value embeddings enter the attention of the layers that
    have them; the final RMSNorm."""
    cfg, n = model.config, model.config.n_layer
    rms = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + train_gpt2.RMS_EPS)  # noqa: E731
    x0 = rms(model.transformer.wte(idx))
    x, outputs = x0, {}
    for i, block in enumerate(model.transformer.h):
        mirror = n - 1 - i
        if cfg.unet_skips and mirror < n // 2:
            x = x + model.skip_weights[i - (n - n // 2)] * outputs[mirror]
        if cfg.x0_mix:
            x = model.resid_lambdas[i] * x + model.x0_lambdas[i] * x0
        ve = model.value_embeds[str(i)](idx) if cfg.value_embeds and str(i) in model.value_embeds else None
        x = x + block.attn(block.ln_1(x), None, ve)
        x = x + block.mlp(block.ln_2(x))
        outputs[i] = x
    return rms(x)


@pytest.mark.parametrize("n_layer", [4, 5])
def test_the_trunk_is_the_one_written_out(n_layer):
    model = speedrun_model(n_layer=n_layer)
    assert [int(k) for k in model.value_embeds] == ([1, 3] if n_layer == 4 else [0, 2, 4])  # every other, the last too
    with torch.no_grad():
        ours, reference = model.hidden_states(tokens()), reference_hidden_states(model, tokens())
    assert (ours - reference).abs().max().item() < 1e-12


def test_the_reference_tells_the_pieces_apart():
    """The comparison above can fail: skip weights paired with the wrong layers give other hidden states."""
    model = speedrun_model()
    with torch.no_grad():
        reference = reference_hidden_states(model, tokens())
        model.skip_weights.copy_(model.skip_weights.flip(0))
        assert (model.hidden_states(tokens()) - reference).abs().max().item() > 1e-3


@pytest.mark.parametrize("field,names", [("x0_mix", {"resid_lambdas", "x0_lambdas"}), ("unet_skips", {"skip_weights"}),
                                         ("value_embeds", {"value_embeds.0.weight", "value_embeds.2.weight",
                                                           "value_embeds.4.weight", "transformer.h.0.attn.ve_gate.weight",
                                                           "transformer.h.2.attn.ve_gate.weight",
                                                           "transformer.h.4.attn.ve_gate.weight"})])
def test_each_switch_takes_its_parameters_and_changes_the_model(field, names):
    on, off = speedrun_model(), speedrun_model(**{field: False})
    on_names, off_names = dict(on.named_parameters()), dict(off.named_parameters())
    assert set(on_names) - set(off_names) == names and set(off_names) <= set(on_names)
    with torch.no_grad():  # the shared weights, and the logits still differ
        for name, p in off.named_parameters():
            p.copy_(on_names[name])
        real = slice(0, GPT2_VOCAB_SIZE)  # (the padding's logits are -inf in both)
        assert (on(tokens())[0][..., real] - off(tokens())[0][..., real]).abs().max().item() > 1e-3
    with torch.no_grad():
        assert (reference_hidden_states(off, tokens()) - off.hidden_states(tokens())).abs().max().item() < 1e-12


def test_qk_norm_zero_init_and_the_activation_are_the_configs():
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, arch="speedrun"))
    for block in model.transformer.h:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()  # zero-initialised
        assert block.attn.c_q.weight.std() > 0.01
        assert isinstance(block.mlp.act, train_gpt2.ReLUSquared) and block.mlp.c_fc.bias is None
        assert isinstance(block.attn.q_norm, torch.nn.RMSNorm) and block.attn.q_norm.weight is None  # no gains
    plain = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, arch="speedrun",
                                                     zero_init=False, qk_norm=False, mlp_act="swiglu"))
    block = plain.transformer.h[0]
    assert block.attn.c_proj.weight.any() and isinstance(block.attn.q_norm, torch.nn.Identity)
    assert isinstance(block.mlp, train_gpt2.SwiGLU)


def test_the_head_is_softcapped_and_the_chunked_loss_follows_it():
    """logits = c tanh(h W^T / c) with h the final hidden states; the chunked loss head computes the loss of those
    logits and its gradients as F.cross_entropy does through them (fp64: rounding ~1e-15)."""
    model = speedrun_model()
    cap = model.config.logit_softcap
    idx = tokens()
    with torch.no_grad():
        logits = model(idx)[0][..., :GPT2_VOCAB_SIZE]  # (the padding's are -inf: tests/test_padded_vocab.py)
        expected = cap * torch.tanh(F.linear(model.hidden_states(idx), model.lm_head.weight) / cap)[..., :GPT2_VOCAB_SIZE]
    assert cap == 15.0 and (logits - expected).abs().max().item() < 1e-12 and logits.abs().max() < cap
    hidden = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(300, 32, dtype=torch.float64) * 3).requires_grad_()  # logits well into tanh's bend
    target = torch.randint(0, 300, (40,))
    target[3] = -1  # ignored
    ours = chunked_cross_entropy(hidden, weight, target, chunk_size=7, softcap=cap)
    ours.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    want = F.cross_entropy(cap * torch.tanh(hidden @ weight.t() / cap), target, ignore_index=-1)
    want.backward()
    assert abs(ours.item() - want.item()) < 1e-12
    assert (got[0] - hidden.grad).abs().max().item() < 1e-12 and (got[1] - weight.grad).abs().max().item() < 1e-12


@pytest.mark.parametrize("prompt", [1, 7])
def test_greedy_with_the_cache_is_greedy_recomputing(prompt):
    """Value embeddings, skips and x0 at each new position: every step's logits with the key/value cache equal
    those of the whole prefix run again."""
    model = speedrun_model()
    idx = tokens(n=prompt)
    with torch.no_grad():
        cached = model.generate(idx, 12, temperature=0)
        again = model.generate(idx, 12, temperature=0, use_cache=False)
        assert torch.equal(cached, again)
        cache = train_gpt2.KVCache(model.config, 2, 20, "cpu", torch.float64)
        first = model.decode_step(cached[:, :prompt], cache)
        assert (first - model(cached[:, :prompt])[0][:, -1, :GPT2_VOCAB_SIZE]).abs().max().item() < 1e-10
        for t in range(prompt, prompt + 4):
            step = model.decode_step(cached[:, t : t + 1], cache)
            assert (step - model(cached[:, : t + 1])[0][:, -1, :GPT2_VOCAB_SIZE]).abs().max().item() < 1e-10


def test_the_optimizer_gives_each_kind_of_parameter_its_rate():
    model = speedrun_model().float()
    settings = OptimizerSettings("muon", 3e-3, 0.0, {"embed": 0.3, "head": 0.008, "scalar": 0.04},
                                 {"muon_lr": 0.02, "muon_momentum_warmup": 4})
    optimizer = model.configure_optimizers(settings, "cpu")
    names = {id(p): name for name, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.matrices.param_groups for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")}
    width = (768 / 32) ** 0.5  # nanochat's scaling of the embeddings' and the head's rates with width
    want = {"embed": ({"transformer.wte.weight", *(n for n in names.values() if n.startswith("value_embeds."))}, 0.3 * width),
            "head": ({"lm_head.weight"}, 0.008 * width),
            "scalar": ({"resid_lambdas", "x0_lambdas", "skip_weights"}, 0.04)}
    groups = optimizer.adamw.param_groups
    assert len(groups) == 3
    for group, (members, rate) in zip(groups, want.values()):
        assert {names[id(p)] for p in group["params"]} == members
        assert group["lr_scale"] * 3e-3 == pytest.approx(rate) and group["weight_decay"] == 0.0
    # Muon's momentum climbs from 0.85 to 0.95 over its first 4 steps, then stays
    seen = []
    for _ in range(6):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        seen.append(optimizer.matrices.param_groups[0]["momentum"])
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])


def test_the_recipe_is_one_flag():
    args = train_gpt2.parse_args(["--recipe", "speedrun", "--max_steps", "500"])
    assert (args.arch, args.optimizer, args.lr_schedule, args.grad_clip) == ("speedrun", "muon", "wsd", 0.0)
    assert (args.embed_lr, args.head_lr, args.scalar_lr, args.muon_momentum_warmup) == (0.3, 0.008, 0.04, 100)
    assert train_gpt2.parse_args(["--recipe", "speedrun", "--grad_clip", "1"]).grad_clip == 1.0  # flags win
    config = train_gpt2.model_config(args)
    assert (config.mlp_act, config.logit_softcap, config.tie_embeddings, config.qk_norm) == ("relu2", 15.0, False, True)


# -----------------------------------------------------------------------------
# Training


@pytest.fixture(scope="module")
def speedrun_runs(tmp_path_factory):
    """A 6-step speedrun straight, and killed after step 3's checkpoint and resumed."""
    return straight_and_resumed(tmp_path_factory.mktemp("speedrun"), SPEEDRUN)


def test_a_resumed_speedrun_logs_exactly_the_straight_runs_losses(speedrun_runs):
    assert numbers_logged(speedrun_runs["straight"]) == numbers_logged(speedrun_runs["resumed"])
    ckpt = load_checkpoint(find_checkpoints(speedrun_runs["straight"])[0])
    assert ckpt["config"]["arch"] == "speedrun" and ckpt["optimizer"]["steps"] == 6  # Muon's warm-up position
    assert {"resid_lambdas", "skip_weights", "value_embeds.1.weight"} <= set(ckpt["model"])


def test_recompute_is_the_same_speedrun(speedrun_runs):
    log_dir = str(speedrun_runs["tmp"] / "recompute")
    train_gpt2.main([*speedrun_runs["flags"], "--log_dir", log_dir, "--recompute"])
    assert read_log(log_dir) == read_log(speedrun_runs["straight"])


def test_sampling_hellaswag_plots_and_export(speedrun_runs, tmp_path, capsys):
    run = speedrun_runs["straight"]
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", run, "--prompt", "Hello", "--num_samples",
                                "1", "--max_new_tokens", "5", "--device", "cpu")
    assert code == 0 and "--- sample 1/1 ---" in out, err
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", run, "--int8", "--prompt", "Hello",
                                "--num_samples", "1", "--max_new_tokens", "5")
    assert code == 0, err
    data = write_hellaswag(str(tmp_path / "hs.jsonl"), n=8)
    code, out, err = script_cli(capsys, hellaswag.main, "--checkpoint", run, "--data", data, "--device", "cpu")
    assert code == 0 and "acc_norm" in out, err
    result = script_cli(capsys, generate_tokens.main, "--checkpoint", run, "--export_hf", tmp_path / "hf")
    assert_cli_error(result, "no transformers class computes --arch speedrun", "gpt2, llama")
    assert not (tmp_path / "hf").exists()


def test_a_resume_is_judged_by_the_recipe_it_stands_for(speedrun_runs, capsys):
    log_dir = copy_of_run(speedrun_runs, "recipe_resume")
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--recipe", "modern")
    assert_cli_error(result, "--recipe modern", "conflicts with the checkpoint's arch speedrun")
    code, _, err = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--recipe", "speedrun",
                              "--max_steps", "7")
    assert code == 0, err
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--max_steps", "8", "--embed_lr", "0.1")
    assert_cli_error(result, "--embed_lr 0.1 conflicts with the checkpoint's 0.3")


@pytest.mark.slow  # torchrun: the full suite's
def test_two_processes_train_like_one(speedrun_runs, capsys):
    assert_two_processes_train_like_one(speedrun_runs, capsys)


@pytest.mark.slow  # torch.compile: the full suite's
def test_a_speedrun_trains_compiled_like_eager(speedrun_runs):
    flags = [*speedrun_runs["flags"], "--eval_every", "0", "--max_steps", "2"]
    train_gpt2.main([*flags, "--log_dir", str(speedrun_runs["tmp"] / "compiled"), "--compile"])
    eager, compiled = read_log(speedrun_runs["straight"])["train"], read_log(str(speedrun_runs["tmp"] / "compiled"))["train"]
    assert all(abs(eager[s] - compiled[s]) < 1e-4 for s in (0, 1)), (eager, compiled)


@pytest.mark.parametrize("extra,named", [
    (["--recipe", "speedrun", "--x0_mix", "--arch", "llama"], "--x0_mix is an option of --arch speedrun"),
    (["--recipe", "speedrun", "--logit_softcap", "-1"], "--logit_softcap -1.0: must be 0 (off) or more"),
    (["--muon_momentum_warmup", "10"], "--muon_momentum_warmup does nothing with --optimizer adamw"),
    (["--recipe", "speedrun", "--embed_lr", "0"], "--embed_lr 0.0: must be a finite number > 0"),
])
def test_bad_speedrun_flags_are_one_line(shards, tmp_path, capsys, extra, named):
    assert_refused_before_any_work(capsys, shards, tmp_path, extra, named)


def test_dataclasses_replace_keeps_a_speedrun_a_speedrun():
    """make_gpt picks the class from the config, so every script's way in builds the trunk."""
    config = dataclasses.replace(train_gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32), arch="speedrun")
    assert type(train_gpt2.make_gpt(config)) is train_gpt2.SpeedrunGPT
