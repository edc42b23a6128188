"""The command-line kit every stage and bench script ends in (it imports no stage). Every stage parses with
ArgumentParser (a bad flag: one line, exit 2), declares each number's range with `number` (what makes no
sense is refused before any work), guards what it writes with files.check_out_dir, and ends in `run_cli`:
an expected error is one line, exit 1; Ctrl-C, SIGTERM, SIGHUP, SIGUSR1 exit 128 + the signal's number; a
closed pipe, a full standard output or a failed allocation is one line too.
"""
import argparse
import math
import os
import re
import signal
import sys
import threading

import torch
from safetensors import SafetensorError

from qerl import devices


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
    """sys.stdout while a run trains: a write to a closed pipe (`qerl/train.py | head -5`) silences the output
    and sets `closed` instead of raising mid-step, so that the run stops at the step's end with a checkpoint,
    as for SIGPIPE's signal (runs.StopAtStepEnd reads `closed`)."""

    def __init__(self, stream):
        self.stream, self.closed = stream, False

    def write(self, text):
        if not self.closed and self.stream is not None:  # None: started with `>&-`, print writes nothing
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._close()
        return len(text)

    def flush(self):
        if not self.closed and self.stream is not None:
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
MEMORY_FLAGS = {"rollout.py": "--num-samples or --max-new-tokens",
                "aqn.py": "--prompts, --samples or --max-new-tokens (or --dtypes bfloat16 alone)",
                "train.py": "--batch, --group, --max-new-tokens, --eval-chunk or --micro-batch (or add "
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
    to lower, and a failed write to standard output one naming it. Before main: no usable temporary folder is
    one line naming TMPDIR (devices.temp_folder_problem), exit 1."""
    main_thread = threading.current_thread() is threading.main_thread()  # only it can take signals
    previous = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS[1:]} if main_thread else {}
    stdout = sys.stdout
    if stdout is not None and not isinstance(stdout, StdoutGuard):  # None: started with `>&-`, print writes nothing
        sys.stdout = StdoutGuard(stdout)
    try:
        if (problem := devices.temp_folder_problem()) is not None:  # torch needs one from the first layer on
            say_error(f"error: {problem}")
            return 1
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
