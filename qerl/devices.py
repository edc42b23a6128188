"""Where and in what a stage computes, and how much memory it may take: the device (--device, autodetect,
a model's device), the compute dtype (--dtype auto and why), the memory free on a GPU or under a CPU's limits
(RAM, a container's cgroup, `ulimit -v`), a process's peak RSS and freed heap, oneDNN's kernel caches and
torch.compile's cache folder. Plumbing beneath the stages: it imports no stage.
"""
import contextlib
import ctypes
import functools
import itertools
import os
import resource
import sys
import tempfile

import torch


def autodetect_device():
    """The one device rule every stage uses: the GPU when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_device(name=None):
    """--device as a torch.device: autodetect for None; one clear error for a name torch does not know or
    a GPU that is not there (instead of a traceback at the first tensor moved)."""
    try:
        device = torch.device(name or autodetect_device())
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but no GPU is available here: use --device cpu (or leave "
                         f"--device out to autodetect)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported: use cpu or cuda")
    return device


def model_device(model):
    """The device of a module's first parameter or buffer (the CPU for a module with neither)."""
    t = next(itertools.chain(model.parameters(), model.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


# -----------------------------------------------------------------------------------------------------
# Memory: what an allocation can still take on a GPU or under a CPU's limits, and what a process holds


def free_memory(device):
    """Bytes a new allocation can still take on `device` (None where unknown): the GPU's free memory plus
    what torch's caching allocator holds unused; on the CPU, the least that cpu_memory_limits leaves."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return min(cpu_memory_limits().values(), default=None)


CGROUP = "/sys/fs/cgroup"  # the container's own cgroup: v2's files at its root, v1's memory controller in memory/
# (limit, usage, the usage's reclaimable page cache in memory.stat) of cgroup v2, then v1; "max": no limit
CGROUP_FILES = (("memory.max", "memory.current", "inactive_file"),
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"))


def _read_numbers(path, keys):
    """{key: int} of the `key value` lines of a /proc or cgroup file (kB units stay as written)."""
    with open(path) as f:
        return {words[0]: int(words[1]) for words in map(str.split, f) if words and words[0] in keys}


def cpu_memory_limits():
    """{what: bytes it leaves} for every limit on this process's CPU memory that can be read: the RAM Linux
    calls available (MemAvailable), the cgroup's limit (a container's: v2 memory.max, v1 memory.limit_in_bytes)
    less its usage (less the page cache it can drop, as the kubelet counts), and `ulimit -v` (RLIMIT_AS) less
    the address space this process maps already. Each one refuses an allocation on its own."""
    limits = {}
    with contextlib.suppress(OSError, KeyError, ValueError):
        limits["RAM available"] = _read_numbers("/proc/meminfo", ["MemAvailable:"])["MemAvailable:"] * 1024
    for limit_file, usage_file, cache in CGROUP_FILES:
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(CGROUP, limit_file)) as f:
                limit = f.read().strip()
            if limit == "max" or int(limit) >= 2 ** 60:  # v1 writes "no limit" as a number near 2^63
                continue
            with open(os.path.join(CGROUP, usage_file)) as f:
                used = int(f.read())
            with contextlib.suppress(OSError, ValueError):
                used -= _read_numbers(os.path.join(CGROUP, os.path.dirname(usage_file), "memory.stat"),
                                      [cache]).get(cache, 0)
            limits["memory left in this container's limit (cgroup)"] = max(int(limit) - used, 0)
            break
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        with contextlib.suppress(OSError, KeyError, ValueError):
            mapped = _read_numbers("/proc/self/status", ["VmSize:"])["VmSize:"] * 1024
            limits["address space left under `ulimit -v` (RLIMIT_AS)"] = max(address_space - mapped, 0)
    return limits


# oneDNN, which runs torch's bf16 matmuls on a CPU, keeps a built kernel for every matmul shape it has met, in
# two caches of 1,024 entries each. The update's rows change length every step, so each step meets new shapes:
# the documented SmolLM2 run's live heap grew by ~10 MB a step (0.5 GB in 60 steps) until both caches were
# capped. 128 entries hold a step's shapes. oneDNN reads these at its first matmul, so setting them at import
# is in time; a value already in the environment wins.
ONEDNN_CACHE_VARS, ONEDNN_CACHE_ENTRIES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"), "128"
for _name in ONEDNN_CACHE_VARS:
    os.environ.setdefault(_name, ONEDNN_CACHE_ENTRIES)


def temp_folder_problem():
    """Why this process has no temporary folder, in one line naming TMPDIR and what to do, or None. torch needs
    one from a model's first layer on (building a module reads its compile cache's folder, which defaults to the
    temporary folder), so without one every command stopped there on tempfile's errno line. Python takes the
    first folder that takes a file among TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp and the current folder:
    "no usable" means none does (tempfile.gettempdir raises). A TMPDIR that cannot be used while another folder
    can is usable, with a note saying where the temporaries go instead."""
    wanted = os.environ.get("TMPDIR", "")
    try:
        folder = tempfile.gettempdir()
    except OSError as e:  # FileNotFoundError: "No usable temporary directory found in [...]"
        tried = str(e.strerror or e).partition(" found in ")[2] or "TMPDIR, /tmp, /var/tmp, the current folder"
        return (f"no usable temporary folder: TMPDIR {_unusable_because(wanted) or wanted + ' takes no file'}, and "
                f"none of the folders Python falls back to takes a file either (it tried {tried}); torch needs one: "
                f"set TMPDIR to a writable folder (mkdir -p ~/tmp && export TMPDIR=~/tmp)")
    if wanted and os.path.abspath(wanted) != folder and (why := _unusable_because(wanted)):
        print(f"note | TMPDIR {why}: temporaries (torch's caches) go to {folder}", flush=True)
    return None


def _unusable_because(folder):
    """Why TMPDIR's value `folder` cannot hold a temporary file, or None where it can (a file is made and removed,
    as tempfile tries: root passes os.access on a read-only mount or /proc)."""
    if not folder:
        return "is not set"
    if not os.path.isdir(folder):
        return f"{folder} {'is not a folder' if os.path.exists(folder) else 'does not exist'}"
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return f"{folder} is not writable"
    return None


def compile_cache_problem():
    """Why torch.compile cannot run here, in a few words, or None: inductor writes the code it generates into
    a cache folder (TORCHINDUCTOR_CACHE_DIR, else torchinductor_<user> in the temporary folder: TMPDIR, /tmp,
    /var/tmp, the current folder), and with none writable dynamo fails at the first compiled call, at length.
    An empty TORCHINDUCTOR_CACHE_DIR would put inductor's folders in the current folder: it is unset, with a note."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ and not os.environ["TORCHINDUCTOR_CACHE_DIR"].strip():
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        print("note | TORCHINDUCTOR_CACHE_DIR is empty, which would write inductor's cache folders into the current "
              "folder: left unset (its folder in the temporary folder)", flush=True)
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the temporary folder")  # inductor's rule, read here: an
    try:  # import of inductor to ask it would fail as compile does
        folder = folder if "TORCHINDUCTOR_CACHE_DIR" in os.environ else tempfile.gettempdir()
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:  # gettempdir's FileNotFoundError: no writable one among TMPDIR, /tmp, /var/tmp, here
        return (f"inductor's cache folder {folder} is not writable ({e.strerror or e}); set TORCHINDUCTOR_CACHE_DIR "
                f"(or TMPDIR) to a writable folder")
    return None


def peak_rss_bytes():
    """This process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@functools.cache
def _glibc():
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:  # musl and others: no malloc_trim
        return None


def release_freed_memory():
    """Hand the heap memory torch has freed back to the OS (glibc's malloc_trim): most of a step's tensors
    are a few MB, below glibc's mmap threshold, so without this the RSS of one phase (the update's
    activations) stays under the next (an evaluation) and the peaks add up. A no-op without glibc."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def check_memory_fits(need, device, what):
    """Refuse, before allocating, what needs more than `device` has free: one line with both figures.
    `need` is an estimate in bytes, `what` names the request (the flags that set its size)."""
    free = free_memory(device)
    if free is not None and need > free:
        cpu = torch.device(device).type == "cpu"
        where = next((k for k, v in cpu_memory_limits().items() if v == free), "RAM available") if cpu \
            else "GPU memory free"
        raise ValueError(f"{what} needs about {need / 2 ** 30:.1f} GiB, and this machine has {free / 2 ** 30:.1f} GiB "
                         f"of {where}: lower those sizes")


# -----------------------------------------------------------------------------------------------------
# The compute dtype: --dtype auto picks the fastest that is safe, and says why

DTYPES = ("auto", "float32", "bfloat16", "float16")  # what every --dtype takes
# --dtype auto gives a CPU bf16 only from this hidden size up: below it the matmuls are too small for bf16's
# faster kernels to outweigh the conversions around them (bench/profile_step.py measures both; docs/real-model.md)
AUTO_BF16_MIN_HIDDEN = 512


def cpu_has_native_bf16():
    """True where the CPU multiplies bf16 in hardware (amx_bf16 or avx512_bf16 among /proc/cpuinfo's flags).
    Elsewhere torch emulates bf16 with conversions, slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(name, device, hidden_size=None):
    """--dtype as (torch dtype, why). auto: bfloat16 on CUDA; on a CPU, bfloat16 where its bf16 matmul is native
    and the model is wide enough to gain (hidden_size >= AUTO_BF16_MIN_HIDDEN), else float32. The rule reads
    the hardware and the config, never a timing: a seeded run picks the same dtype every time."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    if name != "auto":
        return getattr(torch, name), "--dtype"
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    if not cpu_has_native_bf16():
        return torch.float32, "auto: this CPU has no native bf16"
    if not isinstance(hidden_size, int):  # no config to go by: the safe choice
        return torch.float32, "auto: the model's hidden size is unknown"
    if hidden_size < AUTO_BF16_MIN_HIDDEN:
        return torch.float32, f"auto: hidden size {hidden_size} < {AUTO_BF16_MIN_HIDDEN}, too small to gain from bf16"
    return torch.bfloat16, "auto: native bf16 (AMX or AVX512-BF16)"
