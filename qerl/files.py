"""Files written whole and read with care, beneath every stage (it imports no stage): atomic writes (a
reader sees the old file or the new one, never half), the temporaries a killed writer leaves, output folders
(one writer at a time under a lock file, a manifest of what a command wrote, --force replacing only that),
readers that refuse a pipe or a device (JSON, text), and the path rules: no symbolic link where a command
writes, plain names from a file's contents, an output folder that is not an input.
"""
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat

from safetensors import SafetensorError


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
# Reading a file: a regular one only, one line for what cannot be read


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


# -----------------------------------------------------------------------------------------------------
# Names and links: what a name read from a file may be, what a command never writes through


def is_plain_name(name):
    """Whether `name` (read from a file: an index entry, a manifest line) names a file right inside its
    folder: a string without a folder separator, not '', '.' or '..', no NUL. A plain name can still be a
    link the folder's owner made (the Hugging Face cache links each file of a snapshot to its blob)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and "\0" not in name)


def file_kind(mode):
    """What a non-regular file is, in words (hf_files names a --model that is one)."""
    kinds = [(stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")]
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def check_regular(path):
    """Refuse a path that is not a regular file (after links): reading a pipe blocks until a writer comes, a
    device (/dev/zero) never ends. One line naming it; a missing file is the FileNotFoundError of os.stat."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is {file_kind(mode)}, not a regular file: put the file itself there")


def open_regular(path, mode="rb"):
    """open(path, mode) for reading, refused (check_regular's line) unless it is a regular file. Opened
    non-blocking, so that a pipe swapped in after the check does not block either."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {file_kind(st.st_mode)}, not a regular file: put the file itself there")
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
            what = "has other names (hard links)" if stat.S_ISREG(st.st_mode) else f"is {file_kind(st.st_mode)}"
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


def check_out_path(out, inputs=()):
    """An output folder's path: not a file, and neither one of `inputs` nor a folder containing one; and a umask
    that lets the owner read, write and enter what the command makes (umask 0777 left a mode-000 folder)."""
    mask = os.umask(0o022)
    os.umask(mask)  # os.umask only reads by setting: the old mask is back
    if mask & 0o700:
        raise ValueError(f"the umask {mask:04o} takes the owner's own rights from every folder and file this "
                         f"command would make (a folder of mode {0o777 & ~mask:03o}): run it under umask 022 or 077")
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
