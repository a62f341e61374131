"""
What a run needs of the machine and of its fellow processes: the device and its precision, whether
torch.compile works there, signals, the agreement of torchrun's ranks (rank 0's work, the stop flag, a
peer that is gone), and console output that survives a stdout it cannot write.
"""

import os
import re
import signal
import socket
import sys
import threading
from contextlib import contextmanager, nullcontext

import torch

from nanogpt.checkpoints import find_checkpoints
from nanogpt.cli import ReportedByRankZero, UserError, brief, silence_stdout


def pick_device(name="auto"):
    if name != "auto":
        kind = name.split(":")[0]
        if kind == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available here; use --device cpu or auto")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise UserError(f"--device {name}: MPS is not available here; use --device cpu or auto")
        if kind not in ("cuda", "mps", "cpu"):
            raise UserError(f"--device {name}: expected auto, cpu, cuda, cuda:N or mps")
        return name
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name, device_type):
    """auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on cpu/mps."""
    if name == "auto":
        if device_type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    return name


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast_context(device_type, dtype):
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def peak_flops(device):
    """Dense bf16 peak of the GPU, for MFU; None where unknown."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
                       ("L40S", 362e12), ("A10G", 125e12)):
        if key in name:
            return flops
    return None


# What a layer (an nn.Module of the model) whose cost depends on the values declares, for MFU and the memory estimate:
# - active_fraction (an attribute): the share of its parameters, and of its matrix multiplications' FLOPs, that one
#   token goes through: a mixture of experts' top-k of E experts declares k / E on its experts (a ModuleList does);
# - extra_activation_bytes(a) (a method): the bytes per token it keeps for backward beyond what the memory estimate's
#   formula counts for the model's config (nanogpt.arguments.peak_bytes_by_moment; mlp_kept_bytes is its count of one
#   MLP), at a bytes an activation (2 under autocast, 4 in fp32).
# A layer that cannot run on the meta device and declares no active_fraction is named by uncounted_layer.


def declared_fractions(model):
    """[(name, layer)] of model's layers that declare an active_fraction, the outermost of nested ones."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "active_fraction") and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def active_parameters(model):
    """model's parameters, each counted at the active_fraction of the layer that declares one around it."""
    fraction = {id(p): layer.active_fraction for _, layer in declared_fractions(model) for p in layer.parameters()}
    return sum(p.numel() * fraction.get(id(p), 1) for p in model.parameters())


def meta_step(make_model, loss_of, seq_len, counters=(None, None)):
    """loss_of(model, x, y)'s forward and backward over one sequence of seq_len tokens, on the meta device (shapes
    only: no memory, no arithmetic), by the model make_model() builds there, each under its counter (a
    FlopCounterMode, or None). Returns (model, None, None), or where it cannot run (an operation whose output's shape
    depends on the values, an assert on the device) (model, [the layers running when it failed, outermost first], the
    error)."""
    model, running = None, []

    def leave(module, args, out):  # (a forward hook's return value would replace the output)
        running.pop()
    push = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: running.append(module))
    pop = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        with torch.device("meta"):
            model = make_model()
            x = torch.zeros((1, seq_len), dtype=torch.long)
            with counters[0] or nullcontext():
                loss, _ = loss_of(model, x, x)
            with counters[1] or nullcontext():
                loss.backward()
    except Exception as e:  # noqa: BLE001 (an assert on the device, a table keyed by it, a shape of the values)
        return model, running or [model], e  # (none running: in backward, or in building it)
    finally:
        push.remove()
        pop.remove()
    return model, None, None


def counted_flops_per_token(make_model, loss_of, seq_len, say=None):
    """The FLOPs per token of a training step's matrix multiplications (torch.utils.flop_counter's count of mm,
    bmm and attention), for MFU: meta_step's (loss_of's forward and backward on the meta device), each layer that
    declares an active_fraction counted at that share of its own FLOPs: three times its forward's, a matrix
    multiplication's backward being twice its forward (the counter's share of the backward by layer is not reliable:
    experts that read one input share its gradient); a layer never called, as a ModuleList of experts: its layers'.
    None where the model cannot run on the meta device (any failure: the formula stands in), said in one line by say
    where given."""
    from torch.utils.flop_counter import FlopCounterMode

    forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
    model, failed, error = meta_step(make_model, loss_of, seq_len, (forward, backward))
    if failed is not None:
        if say:
            say(f"note: MFU's FLOPs per token could not be counted on the meta device ({brief(error)}); MFU uses "
                "the formula 6N + 12·L·H·Q·T")
        return None
    counts, root = forward.get_flop_counts(), type(model).__name__

    def forward_flops(name, layer):
        if f"{root}.{name}" in counts:
            return sum(counts[f"{root}.{name}"].values())
        return sum(forward_flops(f"{name}.{child}", inner) for child, inner in layer.named_children())
    idle = sum((1 - layer.active_fraction) * 3 * forward_flops(name, layer)
               for name, layer in declared_fractions(model))
    return (forward.get_total_flops() + backward.get_total_flops() - idle) / seq_len


def uncounted_layer(make_model, loss_of, seq_len):
    """The layer whose cost MFU's FLOPs cannot know, as "name (class)": the innermost one running where the model
    cannot run on the meta device (meta_step), when neither it, a layer around it nor one inside it declares an
    active_fraction (the formula would count all of its parameters: every expert of a mixture); else None."""
    _, failed, _ = meta_step(make_model, loss_of, seq_len)
    if failed is None or failed[-1] is None:  # (None: make_model's own error, which building the model raises)
        return None
    if any(hasattr(layer, "active_fraction") for layer in [*failed, *failed[-1].modules()]):
        return None
    names = {id(layer): name for name, layer in failed[0].named_modules()}
    return f"{names[id(failed[-1])] or 'the model'} ({type(failed[-1]).__name__})"


def compile_by_default(device_type):
    """torch.compile is on unless asked otherwise where it pays off: CUDA GPUs."""
    return device_type == "cuda"


def _compile_probe(x):
    return torch.sin(x) * 2 + 1


def compile_problem(device):
    """Why torch.compile cannot work on this device, or None. Compilation is lazy, so this compiles and
    runs a one-line function there: the same Dynamo, Inductor and code-generation path (Triton on a
    GPU, a C++ compiler on the CPU) the model's first forward takes, in a few seconds."""
    try:
        x = torch.linspace(-1, 1, 8, device=device)
        if not torch.allclose(torch.compile(_compile_probe)(x), _compile_probe(x)):
            return "the compiled code computes a wrong result"
    except Exception as e:  # no Triton, no C compiler, a GPU its code generator does not support, ...
        for _ in range(5):  # Dynamo wraps the backend's error: name the one underneath
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if inner is None:
                break
            e = inner
        return brief(e)
    return None


def choose_compile(asked, device, say):
    """Whether to torch.compile the model. --compile that cannot work is an error; the default
    (on for CUDA) that cannot work is said once, and the run goes on uncompiled."""
    if not (asked if asked is not None else compile_by_default(device.split(":")[0])):
        return False
    problem = compile_problem(device)
    if problem is None:
        return True
    if asked:
        raise UserError(f"--compile: torch.compile does not work on {device} here ({problem}); run with --no_compile")
    say(f"note: torch.compile does not work on {device} here ({problem}); "
        "running uncompiled (--no_compile skips this check)")
    return False


# What ends a run after its step, with a checkpoint: a scheduler's SIGTERM, Ctrl-C, a closed terminal's SIGHUP, and
# SIGUSR1 (Slurm's warning before a time limit, `#SBATCH --signal=USR1@300`); those a platform lacks are left out
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
                     if hasattr(signal, name))


class StopFlag:
    """Set by STOP_SIGNALS; the loop checks it between steps and checkpoints before leaving."""

    def __init__(self):
        self.set = False

    def __call__(self, signum, frame):
        self.set = True


@contextmanager
def stop_on_signals():
    stop = StopFlag()
    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# The DDP/FSDP model, its raw module and the optimizer of a torchrun worker, kept until the process ends (nanogpt.cli's
# run_cli ends it with os._exit): freeing them frees the process group, which waits for gloo's worker thread while
# holding the GIL, and that thread may need the GIL to release the last collective's tensors: a deadlock after a
# finished run (pytorch/pytorch#190489's teardown race, met ~1 run in 3 on a busy 2-core machine).
KEPT_UNTIL_EXIT = []


class RankZeroWork:
    """The work only rank 0 does (--verify_data, the log folder and its lock, log.txt, checkpoints),
    made to end every rank alike. Under torchrun the error of such work (a UserError, or any other) is held
    on rank 0 until agree(), a collective every rank reaches, and then raised on every rank: rank 0 prints
    it (a traceback for what is not a UserError), the others leave quietly with exit code 2
    (ReportedByRankZero). Raised at once, it would leave the other ranks to die in their next collective
    with gloo's traceback (the peer closed the connection), or with NCCL to wait for a peer that is gone.
    In one process an error is raised at once, as any other."""

    def __init__(self, ddp, master, device):
        self.ddp, self.master, self.device = ddp, master, device
        self.error = None

    def do(self, work, *args):
        """work(*args) on rank 0; nothing on the other ranks, nor on rank 0 once some of its work failed."""
        if not self.master or self.error is not None:
            return None
        try:
            return work(*args)
        except Exception as e:  # a full disk's OSError, a tracker's own error: the other ranks must not wait
            if not self.ddp:
                raise
            self.error = e
            return None

    def agree(self, stop=False):
        """On every rank: raise rank 0's held error, or return whether any rank was asked to stop (a
        signal). One all-reduce answers both, so the training loop's agreement at each step costs no
        extra collective."""
        if not self.ddp:
            return bool(stop)
        import torch.distributed as dist

        flags = torch.tensor([int(bool(stop)), int(self.error is not None)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop_any, failed = flags.tolist()
        if failed:
            message = [str(self.error) if self.master else None]
            dist.broadcast_object_list(message, src=0)  # every rank raises the same error
            if self.master:
                raise self.error
            raise ReportedByRankZero(message[0])
        return bool(stop_any)


def all_reduce_mean(value, ddp, world_size):
    if ddp:
        import torch.distributed as dist

        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value /= world_size
    return value


def console(*parts, **kwargs):
    """print() for the run's progress that survives a stdout it cannot write (`| tee` ended by Ctrl-C, a
    full disk): the run goes on, and checkpoints what it did (run_cli names a full stdout at the end)."""
    try:
        print(*parts, **kwargs, flush=True)
    except (OSError, ValueError):
        silence_stdout()


# How a collective fails when another process of the run has ended (besides torch.distributed.DistError): gloo's
# connection to it closes or resets, NCCL's communicator is aborted or its collective times out.
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|communicator was aborted|remote process exited|"
                       r"[Tt]imed? ?out")


def peer_gone(e):
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or PEER_GONE.search(str(e)) is not None


def peer_gone_error(e, log_dir, rank):
    """The one line a process that outlived another of its run ends with: which checkpoint --resume takes.
    Said by rank 0, and on every other node by its first process (which may have outlived rank 0); the
    other processes end quietly (exit 2): one line per machine, not one per process."""
    reason = PEER_GONE.search(str(e))
    message = peer_gone_message(reason.group(0) if reason else brief(e), log_dir)
    return UserError(message) if speaks_for_its_machine(rank) else ReportedByRankZero(message)


def peer_gone_message(reason, log_dir):
    newest = find_checkpoints(log_dir)
    resume = (f"`--resume` continues from {newest[0]}" if newest
              else "it wrote no checkpoint yet, so the run starts over")
    return f"another process of this run ended ({reason}), so this one stopped too; {resume}"


PEERS_AWAITED_S = 10  # joining the process group takes a moment; waiting longer than this is said


@contextmanager
def waiting_for_peers_said(environ, after_s=PEERS_AWAITED_S):
    """Around joining the process group, which waits (up to its timeout: 30 minutes for gloo, 10 for NCCL) until
    every process of WORLD_SIZE has joined at MASTER_ADDR:MASTER_PORT: a process still waiting after after_s
    seconds says on stderr what for (a process started by hand, or by a launcher, whose peers never came)."""
    line = (f"rank {environ['RANK']} is waiting for the run's other processes ({environ['WORLD_SIZE']} in all, "
            f"WORLD_SIZE) to join at {environ['MASTER_ADDR']}:{environ['MASTER_PORT']} (MASTER_ADDR:MASTER_PORT): "
            "start them (torchrun starts them all: docs/scale.md), or stop this one with Ctrl-C")
    timer = threading.Timer(after_s, lambda: print(line, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def speaks_for_its_machine(rank):
    return rank == 0 or (os.environ.get("LOCAL_RANK") == "0" and os.environ.get("GROUP_RANK", "0") != "0")


def process_start(pid):
    """What tells a live process from a later one given the same PID: its start time in /proc (where there is no
    /proc, True while the PID exists); None once it has ended, as a zombie not yet reaped has."""
    if not os.path.exists("/proc/self/stat"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # it exists, another user's
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, *fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces and ')'
    except OSError:
        return None
    return None if state in ("Z", "X", "x") else fields[18]  # field 22, starttime


def machine_id():
    """What processes that see each other's PIDs share: the boot and the PID namespace (Linux), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() + " " + os.readlink("/proc/self/ns/pid")
    except OSError:
        return socket.gethostname()


def local_peers(rank):
    """On every rank (a collective): the run's other processes on this machine, {rank: (pid, process_start)}."""
    import torch.distributed as dist

    mine = (machine_id(), os.getpid(), process_start(os.getpid()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {r: (pid, start) for r, (machine, pid, start) in enumerate(everyone) if machine == mine[0] and r != rank}


STUCK_GRACE_S = 10  # once a peer is gone, for this process to end by itself first (torchrun kills at 30 s)
CHECK_EVERY_S = 1


class StuckCollectiveWatch:
    """Under torchrun, SIGTERM or Ctrl-C ends a run after its step (StopFlag). But a process blocked in a
    collective that waits for a process that has died (gloo's wait for ZeroRedundancyOptimizer's broadcasts,
    an NCCL collective) never returns to Python, so its signal handler never runs: it said nothing until
    torchrun SIGKILLed it 30 s later. This thread hears the signal through the interpreter's wake-up fd (the
    C-level handler writes it at once), and from then on checks the run's other processes on this machine
    (peers: local_peers(), their PIDs and start times). Only one that is gone ends this process: a peer that is slow or frozen (a slow disk
    or device, a long checkpoint, SIGSTOP) is waited for. Once one is gone, the process has STUCK_GRACE_S to end
    by itself (a collective's own error gives the same line) and is not ended while busy() (rank 0 writing a
    checkpoint); then it prints the one line of a run that lost a process, and ends."""

    def __init__(self, log_dir, rank, peers, busy):
        self.log_dir, self.rank, self.peers, self.busy = log_dir, rank, peers, busy
        self.stopped = threading.Event()

    def start(self):
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: the handler never blocks
        self.old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self.watch, args=(read_fd,), daemon=True).start()
        return self

    def stop(self):
        signal.set_wakeup_fd(self.old_fd)
        self.stopped.set()

    def gone(self):
        """The rank of a peer that has ended, or None."""
        return next((r for r, (pid, start) in self.peers.items() if process_start(pid) != start), None)

    def watch(self, read_fd):
        while os.read(read_fd, 1)[0] not in STOP_SIGNALS:
            pass
        while (rank := self.gone()) is None:
            if self.stopped.wait(CHECK_EVERY_S):
                return
        if self.stopped.wait(STUCK_GRACE_S):
            return
        while self.busy():
            if self.stopped.wait(CHECK_EVERY_S):
                return
        reason = f"rank {rank}, process {self.peers[rank][0]}, is gone"
        if speaks_for_its_machine(self.rank):  # os.write: the main thread may hold sys.stderr's lock
            os.write(2, f"error: {peer_gone_message(reason, self.log_dir)}\n".encode())
        os._exit(2)


def is_out_of_memory(e):
    """Whether an exception is running out of memory: a GPU's (torch.OutOfMemoryError), Apple's (MPS) or a CPU
    allocator's."""
    return isinstance(e, torch.OutOfMemoryError) or any(
        words in str(e) for words in ("can't allocate memory", "not enough memory", "MPS backend out of memory"))
