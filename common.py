"""The project's plumbing, shared by every stage, bench script and asset builder, and importing none of
them: the device choice, atomic writes and output folders (one writer, a manifest of what a command
wrote), the readers of Hugging Face folders and safetensors headers, and the command-line kit (one-line
errors, number ranges, signals). The method lives in the numbered stages; nothing here is QeRL.
"""
import argparse
import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import math
import os
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import threading

import torch
from safetensors import SafetensorError

# -----------------------------------------------------------------------------------------------------
# Devices


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


def compile_cache_problem():
    """Why torch.compile cannot run here, in a few words, or None: inductor writes the code it generates into
    a cache folder (TORCHINDUCTOR_CACHE_DIR, else torchinductor_<user> in the temporary folder: TMPDIR, /tmp,
    /var/tmp, the current folder), and with none writable dynamo fails at the first compiled call, at length."""
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


# -----------------------------------------------------------------------------------------------------
# Atomic writes and temporaries


def _named_for(e, tmp, path):
    """The OSError to report for `e`, raised while writing `tmp` in place of `path`: the file it names moved
    from the temporary to where it was going (the output itself when it names none)."""
    name = getattr(e, "filename", None)
    name = path + name[len(tmp):] if isinstance(name, str) and name.startswith(tmp) else path
    return OSError(getattr(e, "errno", None) or errno.EIO, getattr(e, "strerror", None) or str(e), name)


def atomic_write(path, write):
    """Call write(tmp) with a hidden name next to `path`, then rename it to `path`: a reader (or a resume
    after a crash) sees the old file or folder or the complete new one, never half of it. Returns path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
    old = tmp + ".old"
    for leftover in (tmp, old):  # no live process writes our names: a killed one with our PID left it, or a link
        refuse_link(leftover, f"the temporary of {path}")
        _remove(leftover)
    try:
        write(tmp)
        if os.path.isdir(path) and not os.path.islink(path):  # os.replace cannot overwrite a folder: move it aside
            os.replace(path, old)
        os.replace(tmp, path)  # a link at `path` is replaced, never written through
    except (OSError, SafetensorError) as e:  # a full disk, say: name what was being written, not the temporary
        raise _named_for(e, tmp, path) from None
    finally:
        for leftover in (tmp, old):
            if not os.path.islink(leftover):  # a link planted meanwhile is not ours to remove
                _remove(leftover)
    return path


def _remove(path):
    """Remove a file or folder tree if it is there (a link: only the link)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def write_text(path, text):
    def write(tmp):  # O_EXCL | O_NOFOLLOW: a file or link that appears at the temporary's name is never written into
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666),
                       "w") as f:
            f.write(text)
    return atomic_write(path, write)


def append_line(path, line):
    """Append `line` to the file at `path` (made if missing), never through a symbolic link: a log a planted link
    could send outside its folder is one error naming it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path, "a log")
        raise
    with os.fdopen(fd, "a") as f:
        f.write(line)


def write_json(path, obj):
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(folder, ours):
    """Clear what atomic_write leaves in `folder` when its process is killed mid-write: .NAME.tmpPID and
    .NAME.tmpPID.old of a PID that is gone, for the NAMEs the caller writes there (ours(NAME) is true), so a
    user's look-alike such as .draft.tmp2024 stays. If the kill fell between atomic_write's two renames, NAME
    is missing and .old holds its previous complete version: that is put back. Returns the names removed."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"\.(.+)\.tmp(\d+)(\.old)?", name)
        path, target = os.path.join(folder, name), os.path.join(folder, m.group(1)) if m else None
        if not m or not ours(m.group(1)) or _pid_alive(int(m.group(2))) or os.path.islink(path):
            continue  # a link is never a temporary: atomic_write makes none, so it is not ours to move or remove
        if m.group(3) and not os.path.lexists(target):
            os.replace(path, target)
            continue
        _remove(path)
        removed.append(name)
    return removed


# -----------------------------------------------------------------------------------------------------
# Ownership. One process writes an output folder at a time: it holds an flock on a file in the folder,
# which the kernel releases however the process ends. A command deletes only what it made: the folder's
# manifest lists the files a command wrote there, and --force replaces those and nothing else.

LOCK_FILE = ".qerl.lock"         # locked by the process writing the folder; it holds that process's PID
MANIFEST = "qerl_manifest.json"  # {"command": ..., "files": [...]}: what that command wrote in the folder


class OutputLock:
    """`with OutputLock(folder):` this process is the folder's one writer (the folder is made if missing),
    or one error naming the process that is. On exit, what the lock made goes again: its lock file, and
    the folder if nothing else is in it."""

    def __init__(self, folder):
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)

    def __enter__(self):
        self.made_folder = not os.path.isdir(self.folder)
        os.makedirs(self.folder, exist_ok=True)
        while True:
            self.made_file = not os.path.lexists(self.path)
            self.file = self._open()
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.file.seek(0)
                pid = self.file.read().strip()
                self.file.close()
                raise ValueError(f"{self.folder} is being written by {f'process {pid}' if pid else 'another process'}"
                                 f": one process writes an output at a time; wait for it to end, or choose another "
                                 f"--out") from None
            try:  # the last holder may have removed the file between our open and our lock: then lock the new one
                if os.path.samestat(os.fstat(self.file.fileno()), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            self.file.close()
        self.file.seek(0)
        if not re.fullmatch(r"\d*\n?", self.file.read(64)):  # what a killed holder left: its PID, or nothing
            self.file.close()
            raise ValueError(f"{self.path} holds something other than a process id: it is not a lock file of this "
                             f"project, so it is not overwritten; move it away, or choose another --out")
        self.file.truncate(0)
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def _open(self):
        """The lock file, opened without following a link (a planted link would have the PID written into its
        target), and only as a regular file of its own (not a pipe, nor another name of a user's file)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o644)  # O_APPEND: "a+" as open() makes it, so the PID is written at 0 after the truncate
        except OSError as e:
            if e.errno == errno.ELOOP:
                refuse_link(self.path, "the lock file")
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "has other names (hard links)" if stat.S_ISREG(st.st_mode) else f"is {_kind(st.st_mode)}"
            raise ValueError(f"{self.path} {what}, not a lock file of this project: move it away, or choose "
                             f"another --out")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a+")

    def __exit__(self, *exc):
        with contextlib.suppress(OSError):
            if self.made_file:
                os.remove(self.path)  # before the unlock, so that the next writer locks a file of its own
        self.file.close()
        if self.made_folder:
            with contextlib.suppress(OSError):  # not empty: it holds an output, or a user's files
                os.rmdir(self.folder)
        return False


def output_files(folder, command):
    """The files an earlier run of `command` wrote in `folder` (its manifest's list), or None when the folder
    has no manifest of that command. Only plain names count: a manifest cannot point outside its folder."""
    if os.path.islink(os.path.join(folder, MANIFEST)):  # another folder's manifest would claim this one
        return None
    try:
        manifest = read_json(os.path.join(folder, MANIFEST))
    except ValueError:
        return None
    files = manifest.get("files")
    if manifest.get("command") != command or not isinstance(files, list):
        return None
    return [n for n in files if isinstance(n, str) and n not in ("", ".", "..") and os.path.basename(n) == n]


def write_output(out, write, command):
    """Write `command`'s output folder under OutputLock: write(tmp) makes a temporary folder beside `out`,
    then each of its files moves into `out` with one rename (none is ever half-written) and the manifest
    lists them. In `out` only the files of an earlier run's manifest are replaced or removed; a user's file
    stays, and one that has the name of a new file is an error. Returns the absolute path of out."""
    out = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp{os.getpid()}")  # atomic_write's kind
    with OutputLock(out):
        remove_stale_temps(os.path.dirname(out), lambda name: name == os.path.basename(out))  # a killed run's
        remove_stale_temps(out, lambda name: name == MANIFEST)
        old = set(output_files(out, command) or ())
        refuse_links(out, [MANIFEST, *sorted(old)], command)
        try:
            write(tmp)  # which makes tmp, as for atomic_write
            new = set(os.listdir(tmp))
            taken = sorted(n for n in new - old if os.path.lexists(os.path.join(out, n)))
            if taken:
                raise ValueError(f"{os.path.join(out, taken[0])} was not written by {command}: move it away, or "
                                 f"choose another --out")
            # Listed first, so that a kill during the renames leaves a folder whose every file --force may replace
            write_json(os.path.join(out, MANIFEST), {"command": command, "files": sorted(old | new)})
            for name in sorted(old - new):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(out, name))
            for name in sorted(new):
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
            write_json(os.path.join(out, MANIFEST), {"command": command, "files": sorted(new)})
        except (OSError, SafetensorError) as e:  # a full disk, say: name the output's file, not the temporary
            raise _named_for(e, tmp, out) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -----------------------------------------------------------------------------------------------------
# Reading Hugging Face folders. A safetensors file is: 8-byte little-endian header length, a JSON header
# {name: {dtype, shape, data_offsets}}, then the raw bytes.

ST_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                  "F8_E4M3": 1, "F8_E5M2": 1}


def read_json(path):
    """A JSON object from `path` (every Hugging Face folder file is one); one error naming the file otherwise."""
    try:
        f = open_regular(path, "r")  # a pipe or a device is refused here, in its own words
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        with f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # also what a UTF-8 decoding error is
        raise ValueError(f"{path} is not valid JSON ({e}); write or download it again") from None
    except RecursionError:  # json nests by recursion: a file of 100,000 "[" ends here
        raise ValueError(f"{path} nests its JSON too deeply to be a model file; write or download it again") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} should hold a JSON object {{...}}, found a {type(obj).__name__}")
    return obj


def read_text(path, what=""):
    """A user's text file, whole: a regular file only (a pipe would block the read for good), undecodable bytes
    replaced (a line that holds them is malformed to its parser, not a crash); an OSError is one line."""
    try:
        with open_regular(path) as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read {what}{path}: {e.strerror or e}") from None


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header is refused before it is read


def _unique_keys(pairs):
    """json's object_pairs_hook: a name given twice is an error (json would keep the last one silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        raise ValueError(f"the name {next(k for k, _ in pairs if k in seen or seen.add(k))!r} appears twice in "
                         f"its header")
    return obj


def read_safetensors_header(path):
    """-> ({name: {dtype, shape, data_offsets}}, byte where the data starts). Checked as safetensors checks
    before it reads a tensor, so that a bad file is one line naming it before any work (01 would otherwise
    meet it mid-write): a header of at most MAX_HEADER_BYTES, each name once, string metadata, known dtypes,
    and data_offsets that tile the data exactly, in shape x dtype bytes each (none negative, overlapping,
    apart, past the end, nor bytes left after the last)."""
    try:
        f = open_regular(path)  # a pipe or a device: check_regular's line
    except OSError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:  # random bytes: a "header length" of exabytes
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"its header is {n} bytes, over the {MAX_HEADER_BYTES} safetensors reads")
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        metadata = header.pop("__metadata__", {})
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise ValueError("its __metadata__ must map names to strings")
        for k, v in header.items():
            if v["dtype"] not in ST_DTYPE_BYTES:
                raise ValueError(f"tensor {k} has dtype {v['dtype']}, which this reader does not know")
            shape, offsets = v.get("shape"), v.get("data_offsets")  # JSON: anything may be any type
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and
                    isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
                raise ValueError(f"tensor {k} needs a list of sizes as its shape and two byte offsets as its "
                                 f"data_offsets, got {shape!r} and {offsets!r}")
    except RecursionError:  # a header of 100,000 nested lists
        raise ValueError(f"{path} is not a readable safetensors file (its header nests too deeply)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    end = 0  # checked before anything is written: a cut-off download fails here
    for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        (b, e), nbytes = v["data_offsets"], ST_DTYPE_BYTES[v["dtype"]] * math.prod(v["shape"])
        if b < 0 or e - b != nbytes or b != end:
            where = "is negative" if b < 0 else f"overlaps the tensor before it (which ends at {end})" if b < end \
                else f"leaves a gap after the tensor before it (which ends at {end})" if b > end \
                else f"spans {e - b} bytes, while shape {v['shape']} of {v['dtype']} is {nbytes}"
            raise ValueError(f"{path}: tensor {k}'s data_offsets [{b}, {e}] {where}; the header is corrupt, "
                             f"download or write the file again")
        if 8 + n + e > size:
            raise ValueError(f"{path}: tensor {k} needs bytes {8 + n + b}..{8 + n + e} but the file has {size}; "
                             f"the file is truncated or corrupt, download it again")
        end = e
    if 8 + n + end != size:
        raise ValueError(f"{path} holds {size - 8 - n - end} bytes after its last tensor, which its header does "
                         f"not describe; the file is corrupt, download or write it again")
    return header, 8 + n


def safetensors_problem(path):
    """One line saying what is wrong with a safetensors file (unreadable header, a tensor past the end of
    the file), or None when its header and sizes are sound. For reporting a file safetensors refuses."""
    try:
        read_safetensors_header(path)
    except ValueError as e:
        return str(e)
    return None


def find_weight_files(model_dir):
    """-> (config, {tensor name: shard file name}, has_index); one clear error for a bad folder."""
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        what = "a file" if os.path.isfile(model_dir) else _kind(os.stat(model_dir).st_mode)
        raise ValueError(f"{model_dir} is {what}, not a folder: a model is a Hugging Face folder (config.json, "
                         f"*.safetensors, tokenizer.json); pass the model's folder, not a file")
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder not found: {model_dir}")
    if not os.path.lexists(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model folder)")
    config = read_json(os.path.join(model_dir, "config.json"))  # a pipe or a device: refused, not read
    index = os.path.join(model_dir, "model.safetensors.index.json")
    has_index = os.path.lexists(index)
    if has_index:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        for tensor, shard in weight_map.items():  # a name from a file: it must not lead out of the folder
            if not is_plain_name(shard):
                raise ValueError(f"{index}: weight_map entry {tensor!r} names {shard!r}, which is not a file name "
                                 f"beside the index (a path outside the model folder, or into a subfolder): "
                                 f"every shard must be a file in {model_dir}; fix the index")
    elif os.path.lexists(os.path.join(model_dir, "model.safetensors")):
        weight_map = {k: "model.safetensors" for k in read_safetensors_header(os.path.join(model_dir, "model.safetensors"))[0]}
    else:
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    for shard in sorted(set(weight_map.values())):
        if not os.path.lexists(os.path.join(model_dir, shard)):
            raise FileNotFoundError(f"shard {shard} listed in the index is missing from {model_dir}")
        check_regular(os.path.join(model_dir, shard))
    return config, weight_map, has_index


FLOAT_DTYPES = ("F32", "BF16", "F16")  # a weight or a bias: what torch computes with, as stored
# A compressed-tensors NVFP4 layer's own tensors (01_quantize.py's output): 4-bit codes two to a byte, FP8 block
# scales, an FP32 tensor scale (and vLLM's activation scale, which 03 skips)
NVFP4_DTYPES = {"weight_packed": ("U8",), "weight_scale": ("F8_E4M3",), "weight_global_scale": ("F32",),
                "input_global_scale": ("F32",)}


def _listed_tensor(model_dir, header, name, shard):
    """header[name], or one line saying that the index puts `name` in a shard that does not hold it."""
    if name not in header:
        raise ValueError(f"{os.path.join(model_dir, 'model.safetensors.index.json')} puts {name} in {shard}, which "
                         f"does not hold it: fix the index, or download the folder again")
    return header[name]


def read_weight_headers(model_dir, weight_map):
    """Every shard's header, checked (read_safetensors_header), before any tensor is read -> {shard: header}.
    Each tensor the index lists must be in its shard, and each weight stored in a dtype the stages compute
    with: a weight or a bias in FLOAT_DTYPES, an NVFP4 layer's tensors in NVFP4_DTYPES. Without this an I32
    norm gain was copied by 01 and a traceback in 03, and an F64 projection a dtype clash at its first matmul.
    Other tensors (a rotary inv_freq some exports keep) are never computed with, and pass. 01 and 03 (so 04
    and 05, which load through 03) call it."""
    headers = {s: read_safetensors_header(os.path.join(model_dir, s))[0] for s in sorted(set(weight_map.values()))}
    for name, shard in weight_map.items():
        _listed_tensor(model_dir, headers[shard], name, shard)
    for shard, header in headers.items():
        for name, info in header.items():
            leaf = name.rpartition(".")[2]
            allowed = NVFP4_DTYPES.get(leaf) or (FLOAT_DTYPES if leaf in ("weight", "bias") else None)
            if allowed and info["dtype"] not in allowed:
                what = f"an NVFP4 {leaf}" if leaf in NVFP4_DTYPES else f"a {leaf}"
                raise ValueError(f"{os.path.join(model_dir, shard)}: tensor {name} has dtype {info['dtype']}, but "
                                 f"{what} must be {'one of ' * (len(allowed) > 1)}{', '.join(allowed)}: convert the "
                                 f"checkpoint (its export or its header is wrong)")
    return headers


def check_config_fits_weights(model_dir, config, weight_map):
    """config.json's sizes against the weights it sits beside (dict config; the embedding's shape from its
    safetensors header, the layer indices, lm_head): a config that disagrees is one line naming both, before an
    estimate or an output is made from it. 01 checks a folder before quantizing it, 05 before estimating memory."""
    where = os.path.join(model_dir, "config.json")
    name = "model.embed_tokens.weight"
    if name in weight_map:
        shape = _listed_tensor(model_dir, read_safetensors_header(os.path.join(model_dir, weight_map[name]))[0],
                               name, weight_map[name])["shape"]
        said = [config.get("vocab_size", shape[0]), config.get("hidden_size", shape[-1])]  # what it states
        if shape != said:
            raise ValueError(f"{where} says vocab_size {config.get('vocab_size')} and hidden_size "
                             f"{config.get('hidden_size')}, but {name} is {shape[0]} x {shape[-1]}: the config does "
                             f"not belong to these weights")
    layers = {int(k.split(".")[2]) for k in weight_map if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    n = config.get("num_hidden_layers")
    if layers and n is not None and (type(n) is not int or layers != set(range(n))):
        raise ValueError(f"{where} says num_hidden_layers {config.get('num_hidden_layers')}, but the weights hold "
                         f"layers {min(layers)}..{max(layers)} ({len(layers)} of them): the config does not belong "
                         f"to these weights")
    check_config_booleans(config, where)  # 01 reads tie_word_embeddings without hf_files.check_config
    if name in weight_map and not config.get("tie_word_embeddings", False) and "lm_head.weight" not in weight_map:
        raise ValueError(f"{where} says tie_word_embeddings false, but the weights have no lm_head.weight: set it "
                         f"to true if the model shares its embedding, or add the missing weights")


CONFIG_BOOLEANS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def check_config_booleans(config, where):
    """config.json's true/false fields are JSON booleans (or null): the string "false" is truthy, and read as
    a truth value it would flip the meaning (a tied embedding, and the model's own lm_head dropped)."""
    for k in CONFIG_BOOLEANS:
        if config.get(k) is not None and not isinstance(config[k], bool):
            raise ValueError(f"{where}: {k} must be true or false, got {config[k]!r}")


def is_plain_name(name):
    """Whether `name` (read from a file: an index entry, a manifest line) names a file right inside its
    folder: a string without a folder separator, not '', '.' or '..', no NUL. A plain name can still be a
    link the folder's owner made (the Hugging Face cache links each file of a snapshot to its blob)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and "\0" not in name)


def _kind(mode):
    """What a non-regular file is, in words."""
    kinds = [(stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")]
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def check_regular(path):
    """Refuse a path that is not a regular file (after links): reading a pipe blocks until a writer comes, a
    device (/dev/zero) never ends. One line naming it; a missing file is the FileNotFoundError of os.stat."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is {_kind(mode)}, not a regular file: put the file itself there")


def open_regular(path, mode="rb"):
    """open(path, mode) for reading, refused (check_regular's line) unless it is a regular file. Opened
    non-blocking, so that a pipe swapped in after the check does not block either."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {_kind(st.st_mode)}, not a regular file: put the file itself there")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def refuse_link(path, what):
    """One line if `path` is a symbolic link: a command writes (or reads by a name it trusts) only files it
    makes itself, and a planted link would send that write or read elsewhere."""
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}), and {what} is never one: a link there "
                         f"would send what this command writes (or reads) elsewhere; remove it, or choose another "
                         f"folder")


def refuse_links(folder, names, what="this command"):
    """refuse_link for each of `names` in `folder`: the folder's own files, which `what` writes or reads."""
    for name in names:
        refuse_link(os.path.join(folder, name), f"a file {what} writes")


# -----------------------------------------------------------------------------------------------------
# Command lines. Every stage parses with ArgumentParser (a bad flag: one line, exit 2), declares each
# number's range with `number` (what makes no sense is refused before any work), guards what it writes
# with `check_out_dir` (or its path rules alone, `check_out_path`), and ends in `run_cli` (an expected
# error: one line, exit 1; Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: exit 128 + the signal's number).


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag, not a usage block. No abbreviations: a new flag
    must not change what an old command line (--loss for --loss-agg) means."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _range_text(lo, hi, above, below):
    def show(x):  # an integer bound as written (2147483647), a float one short (1e-06)
        return str(x) if isinstance(x, int) else f"{x:g}"
    parts = [f">= {show(lo)}" if lo is not None else None, f"> {show(above)}" if above is not None else None,
             f"<= {show(hi)}" if hi is not None else None, f"< {show(below)}" if below is not None else None]
    return " and ".join(p for p in parts if p) or "a finite number"


MAX_SEED = 2**31 - 1  # a seed is added to and multiplied into others (steps, ranks): far from int64's end


def number(kind=float, lo=None, hi=None, *, above=None, below=None):
    """An argparse type: kind(text), finite, with lo <= x <= hi and above < x < below (each bound optional).
    NaN, inf and out-of-range values are refused with the allowed range."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        ok = (math.isfinite(x) and (lo is None or x >= lo) and (hi is None or x <= hi)
              and (above is None or x > above) and (below is None or x < below))
        if not ok:
            raise argparse.ArgumentTypeError(f"{text} is out of range: need {_range_text(lo, hi, above, below)}")
        return x
    parse.__name__ = kind.__name__
    return parse


def check_out_path(out, inputs=()):
    """An output folder's path: not a file, and neither one of `inputs` nor a folder containing one."""
    out_real = os.path.realpath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a folder: choose a folder name")
    for src in inputs:
        src_real = os.path.realpath(src)
        if src_real == out_real or src_real.startswith(out_real.rstrip(os.sep) + os.sep):
            relation = "is" if src_real == out_real else "contains"
            raise ValueError(f"--out {out} {relation} the input {src}: writing there would replace it; choose a "
                             f"new folder for the output")


def check_out_dir(out, inputs=(), *, force=False, ours=None, command="this command"):
    """Before any work, refuse an output folder that another process is writing, or whose writing would
    destroy something the command did not make: check_out_path's rules, and an existing non-empty `out`
    needs force, which writes there only when ours(out) recognises an earlier output of `command`."""
    check_out_path(out, inputs)
    if not os.path.isdir(out):
        return
    refuse_links(out, [LOCK_FILE, MANIFEST], command)
    with OutputLock(out):  # a live writer is named here, before any work
        held = [n for n in os.listdir(out) if n != LOCK_FILE]
    if held:
        if not force:
            raise FileExistsError(f"{os.path.abspath(out)} already exists: pass --force to replace it")
        if ours is None or not ours(out):
            raise ValueError(f"--force replaces only an earlier output of {command}, and {out} is not one (no {MANIFEST} "
                             f"of it there): choose a new --out")


EXPECTED_ERRORS = (ValueError, OSError, SafetensorError)  # bad input, a missing or unreadable file, a full disk


def error_line(e):
    """The one line an expected error prints: an OSError as 'file: reason', anything else as its message."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


# Ctrl-C; Slurm or Kubernetes; a closed terminal; the warning Slurm sends before its time limit when asked to
# (`#SBATCH --signal=SIGUSR1@90`, as PyTorch Lightning's Slurm support has it), whose default action is to kill
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """A stop signal raised as Ctrl-C's KeyboardInterrupt is, wherever the program is, so that every
    `finally` and `with` removes its half-written output. Interrupted(message, signum)."""

    def __init__(self, message="", signum=signal.SIGINT):
        super().__init__(message)
        self.signum = signum


def raise_interrupted(signum, frame):  # a signal handler
    raise Interrupted(signum=signum)


def silence_stdout():
    """Point file descriptor 1 at /dev/null: once a pipe's reader has gone (`| head`), what is still buffered
    and every later print goes nowhere, instead of failing again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real descriptor (a test's captured stdout)
        pass
    finally:
        os.close(devnull)


class ClosedPipeGuard:
    """sys.stdout while a run trains: a write to a closed pipe (`05_grpo.py | head -5`) silences the output
    and sets `closed` instead of raising mid-step, so that the run stops at the step's end with a checkpoint,
    as for SIGPIPE's signal (runs.StopAtStepEnd reads `closed`)."""

    def __init__(self, stream):
        self.stream, self.closed = stream, False

    def write(self, text):
        if not self.closed:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._close()
        return len(text)

    def flush(self):
        if not self.closed:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._close()

    def _close(self):
        self.closed = True
        silence_stdout()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


class StdoutGuard:
    """sys.stdout under run_cli: a write that fails names standard output, which the OSError itself does not
    (`[Errno 28] No space left on device` for `> out.log` on a full disk): an OSError naming it, or, for a
    character its encoding cannot write, a ValueError naming PYTHONIOENCODING. A closed pipe stays
    BrokenPipeError, for run_cli and ClosedPipeGuard."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self._do(self.stream.write, text)

    def flush(self):
        return self._do(self.stream.flush)

    def _do(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except UnicodeEncodeError as e:  # the text around it, which often holds the path or flag it came from
            around = e.object[max(e.start - 40, 0):e.end + 20].strip()
            raise ValueError(f"standard output cannot write {e.object[e.start:e.end]!r} (in {around!r}) in its "
                             f"encoding, {e.encoding} (PYTHONIOENCODING or the locale chose it): set "
                             f"PYTHONIOENCODING=utf-8 (utf-8:surrogateescape for a name not valid UTF-8)") from None
        except OSError as e:
            silence_stdout()  # what is still buffered goes nowhere, instead of failing again at exit
            raise OSError(e.errno, f"{e.strerror or e} (is it redirected to a full disk?): free space there, or send "
                          f"the output elsewhere", "standard output") from None

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


# What to lower when a stage runs out of memory, by its file (run_cli's line); others: "the sizes it was given"
MEMORY_FLAGS = {"03_rollout.py": "--num-samples or --max-new-tokens",
                "04_aqn.py": "--prompts, --samples or --max-new-tokens (or --dtypes bfloat16 alone)",
                "05_grpo.py": "--batch, --group, --max-new-tokens, --eval-chunk or --micro-batch (or add "
                              "--grad-checkpoint)"}


def out_of_memory_line(e, command):
    """run_cli's line for an allocation that failed (MemoryError, torch.OutOfMemoryError, the CPU allocator's
    RuntimeError) in `command` (a file name), or None for another error: the size asked, what to lower."""
    text = str(e)
    if not (isinstance(e, MemoryError) or isinstance(e, getattr(torch, "OutOfMemoryError", MemoryError))
            or "can't allocate memory" in text or "out of memory" in text.lower()):
        return None
    size = re.search(r"allocate (\d+) bytes", text)
    size = f"{int(size.group(1)) / 2 ** 30:.2f} GiB" if size else (re.findall(r"allocate ([\d.]+ \w+)", text) or [None])[0]
    lower = MEMORY_FLAGS.get(command, "the sizes it was given")
    return (f"error: out of memory{f' (an allocation of {size} failed)' if size else ''}: lower {lower}, or give "
            f"it more memory (RAM, the container's limit, `ulimit -v`)")


def say_error(line):
    """One line on stderr in one write: torchrun's ranks share the stream, and print's separate write of the
    newline let two ranks' lines run into one ("interruptedinterrupted | ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_cli(main, argv=None):
    """Run a stage's main(argv): an expected error prints `error: ...` on one line and returns 1; Ctrl-C,
    SIGTERM, SIGHUP or SIGUSR1 prints `interrupted` (with the signal's name and the exception's message, e.g.
    how to resume) and returns 128 + the signal's number (130, 143, 129, 138); a closed standard output (`| head`)
    returns 141, as a shell reports SIGPIPE; a failed allocation (out of memory) is one line naming the flags
    to lower, and a failed write to standard output one naming it."""
    main_thread = threading.current_thread() is threading.main_thread()  # only it can take signals
    previous = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS[1:]} if main_thread else {}
    stdout = sys.stdout
    if stdout is not None and not isinstance(stdout, StdoutGuard):  # None: started with `>&-`, print writes nothing
        sys.stdout = StdoutGuard(stdout)
    try:
        code = main(argv) or 0
        if sys.stdout is not None:  # what is still buffered fails here, in one line, not at the interpreter's exit
            sys.stdout.flush()
        return code
    except (MemoryError, RuntimeError) as e:  # RuntimeError: torch's allocators; any other is a bug, raised
        line = out_of_memory_line(e, os.path.basename(getattr(getattr(main, "__code__", None), "co_filename", "")))
        if line is None:
            raise
        say_error(line)
        return 1
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        say_error("interrupted" + name + (f" | {e}" if str(e) else ""))
        return 128 + signum
    except BrokenPipeError:  # before a run's guard (ClosedPipeGuard) is in place: nothing was trained yet
        silence_stdout()
        say_error("error: standard output was closed before the command finished (a pipe's reader, such as `head`, "
                  "exited): send the output to a file, or pipe it to a reader that reads to the end")
        return 128 + signal.SIGPIPE
    except EXPECTED_ERRORS as e:
        say_error(f"error: {error_line(e)}")
        return 1
    finally:
        sys.stdout = stdout
        for s, handler in previous.items():
            signal.signal(s, handler)
