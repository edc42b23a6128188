"""Data parallel under torchrun, and nothing else: `torchrun --nproc_per_node N 05_grpo.py ...` starts N copies
of 05, each with the same adapter (built from --seed) and a contiguous share of the step's prompt groups. NCCL
joins GPUs, gloo joins CPU processes; process 0 alone prints, evaluates and writes files. Every function here is
a no-op in a plain single-process run, so 05's loop reads the same either way. Imports no stage.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist


def init(device):
    """(rank, world_size, device). Joins the process group when torchrun started us (WORLD_SIZE > 1);
    on CUDA each rank takes the GPU of its LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # rank 0 evaluates while the others wait: allow a long evaluation
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=2))
    return dist.get_rank(), dist.get_world_size(), device


def leave(code=0):
    """End a torchrun process. On success the ranks leave together (one that tears gloo down while another
    still works aborts), and every rank skips the interpreter's teardown, where gloo's worker threads can
    still free tensors after Python is gone and abort the process."""
    if code == 0:
        dist.barrier()
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
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def sum_grads(params):
    """Sum every parameter's gradient over processes, in one all_reduce of their concatenation (a
    process with no rows to train on contributes zeros)."""
    if rank_and_world()[1] == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # (P,)
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
