"""Data parallel under torchrun, and nothing else: `torchrun --nproc_per_node N qerl/train.py ...` starts N copies
of 05, each with the same adapter (built from --seed) and a contiguous share of the step's prompt groups and of
the held-out problems. NCCL joins GPUs, gloo joins CPU processes; process 0 alone prints and writes files.
Every function here is a no-op in a plain single-process run, so 05's loop reads the same either way.

No rank waits long for another (each evaluates its share), so every collective has a short timeout
(--dist-timeout): a rank that hangs or dies ends the job in minutes with one line naming it (PeerError), not
after gloo's default of hours or with its traceback. torchrun's variables in a process torchrun did not
start (left in a shell) are one line at once (launch), not a wait for ranks that never come. Imports no stage.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist


class PeerError(ValueError):
    """A collective failed: another rank did not answer within the timeout, or died. One line, naming it."""


TIMEOUT_S = [600.0]  # the collectives' timeout (05's --dist-timeout), set by init
MIN_TIMEOUT_MIN, MAX_TIMEOUT_MIN = 0.1, 1440.0  # --dist-timeout's range in minutes: 6 s (a test's) to a day
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # what torchrun gives each process it starts, read here
TORCHRUN_VARS = (*LAUNCH_VARS, "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")  # to unset


def launch():
    """(rank, world size) as the launcher set them; (0, 1) for a plain `python qerl/train.py`. torchrun's
    variables in a process torchrun did not start (it also sets TORCHELASTIC_RUN_ID), say left in a shell by
    an earlier job, would have this process wait for ranks that never come (WORLD_SIZE=2), or train unheard
    (RANK=1 prints nothing); they, and a set torchrun would not write, are one line, before any wait."""
    given = {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ}
    shown = " ".join(f"{k}={v}" for k, v in given.items())
    try:
        rank, world, local = (int(given.get(k, d)) for k, d in zip(LAUNCH_VARS, ("0", "1", "0")))
    except ValueError:
        raise ValueError(f"{shown}: torchrun's variables are whole numbers; unset them for one process, or "
                         f"launch with torchrun") from None
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        if (rank, world, local) == (0, 1, 0):  # a single process, however it is spelled
            return 0, 1
        left = " ".join(k for k in TORCHRUN_VARS if k in os.environ)
        raise ValueError(f"{shown} is set, but torchrun did not start this process (no TORCHELASTIC_RUN_ID): "
                         f"left over from another job? For one process: unset {left}; for several: torchrun "
                         f"--nproc_per_node N qerl/train.py ...")
    if len(given) < len(LAUNCH_VARS) or not 0 <= rank < world or local < 0:
        raise ValueError(f"torchrun's variables disagree ({shown or 'none of ' + ', '.join(LAUNCH_VARS)}): "
                         f"launch with torchrun alone, without setting them by hand")
    return rank, world


def init(device, timeout_s=600.0):
    """(rank, world_size, device). Joins the process group when torchrun started us (WORLD_SIZE > 1), every
    collective then timing out after timeout_s; on CUDA each rank takes the GPU of its LOCAL_RANK."""
    if launch()[1] == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    TIMEOUT_S[0] = timeout_s
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def _store():
    """The process group's key-value store (torchrun's rendezvous), or None where this torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


SEEN = [0]  # collectives this process has entered: each one is posted to the store as qerl_seen_<rank>


def _failed(e):
    """The PeerError for a failed collective `e`: which ranks are missing (those whose count of collectives
    entered, in the store, is behind this one's), and whether it timed out or a connection closed (a death)."""
    rank, store, missing = dist.get_rank(), _store(), []
    for r in range(dist.get_world_size()) if store is not None else ():
        try:
            seen = int(store.get(f"qerl_seen_{r}")) if store.check([f"qerl_seen_{r}"]) else 0
        except (RuntimeError, ValueError):
            continue
        if seen < SEEN[0]:
            missing.append(r)
    who = f"rank {', '.join(map(str, missing))}" if missing else "another rank"
    text = str(e).lower()
    how = (f"did not answer within --dist-timeout ({TIMEOUT_S[0] / 60:g} min): stuck?" if "timed out" in text or
           "timeout" in text else "closed its connection: it died (killed, or out of memory?)")
    return PeerError(f"rank {rank}: {who} {how}; the job ends here (resume from the last checkpoint)")


def _collective(fn, *a, **kw):
    SEEN[0] += 1
    store = _store()
    try:
        if store is not None:
            store.set(f"qerl_seen_{dist.get_rank()}", str(SEEN[0]))
    except RuntimeError:  # DistNetworkError: torchrun holds the store, so torchrun itself is gone
        raise PeerError(f"rank {dist.get_rank()}: torchrun, which holds the ranks' store, is gone (killed, or "
                        f"stopped by a signal it does not pass on: see --signals-to-handle); the job ends here "
                        f"(resume from the last checkpoint)") from None
    try:
        return fn(*a, **kw)
    except RuntimeError as e:  # DistBackendError: a timeout, or a peer gone
        raise _failed(e) from None


def leave(code=0):
    """End a torchrun process. On success the ranks leave together (one that tears gloo down while another
    still works aborts), and every rank skips the interpreter's teardown, where gloo's worker threads can
    still free tensors after Python is gone and abort the process."""
    if code == 0:
        try:
            _collective(dist.barrier)
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
    if code == 0:  # after a failed collective the teardown can hang: os._exit ends the process instead
        dist.destroy_process_group()

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if is_initialized() else (0, 1)


def shard(items, rank, world):
    """This rank's contiguous share of `items` (shares differ in size by at most one)."""
    return items[rank * len(items) // world:(rank + 1) * len(items) // world]


def global_sum(values, op="sum"):
    """A list of numbers -> each summed (or, op "max", maximised) over all processes."""
    values = [float(v) for v in values]
    if rank_and_world()[1] == 1:
        return values
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=dev)  # (n,)
    _collective(dist.all_reduce, t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def sum_grads(params):
    """Sum every parameter's gradient over processes, in one all_reduce of their concatenation (a
    process with no rows to train on contributes zeros)."""
    if rank_and_world()[1] == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # (P,)
    _collective(dist.all_reduce, flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
