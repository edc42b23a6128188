"""By hand, not in `make test` (about 2 minutes): kill -9 a short 05 run at 20 random moments while it writes
a checkpoint every step, then `--resume` each. Every resume must finish all 80 steps and leave no temporary.

    python tests/kill_9_stress.py
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
flags = ["--steps", "80", "--batch", "2", "--group", "2", "--max-new-tokens", "12", "--eval-size", "0",
         "--save-every", "1", "--time-budget", "0", "--device", "cpu", "--warmup", "1", "--lr", "5e-3", "--quiet"]
env = dict(os.environ, OMP_NUM_THREADS="1")
rng = random.Random(0)
ok = 0
leftovers_seen = 0
work = tempfile.mkdtemp(prefix="kill9-")
for i in range(20):
    out = os.path.join(work, f"run{i}")
    p = subprocess.Popen([PY, f"{ROOT}/qerl/train.py", *flags, "--out", out], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(2.0, 7.0))  # start-up ~2-3 s, then ~50 ms steps with a checkpoint each
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = [n for n in os.listdir(out) if ".tmp" in n] if os.path.isdir(out) else []
    leftovers_seen += bool(left)
    ckpts = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) if os.path.isdir(out) else []
    if not ckpts:  # killed before the first checkpoint: nothing to resume, and --resume says so
        r = subprocess.run([PY, f"{ROOT}/qerl/train.py", "--resume", out], env=env, capture_output=True, text=True)
        good = r.returncode == 1 and "no checkpoint there" in r.stderr
        ok += good
        print(f"kill {i} | before the first checkpoint | resume refused: {good}", flush=True)
        continue
    r = subprocess.run([PY, f"{ROOT}/qerl/train.py", "--resume", out, "--quiet"], env=env, capture_output=True, text=True)
    done = json.load(open(f"{out}/summary.json"))["steps_done"] if r.returncode == 0 else None
    after = [n for n in os.listdir(out) if ".tmp" in n]
    good = r.returncode == 0 and done == 80 and not after
    ok += good
    print(f"kill {i} | checkpoints at kill {len(ckpts)} | temporaries left {left} | resume rc {r.returncode} | "
          f"steps {done} | temporaries after {after}" + ("" if good else f" | FAIL {r.stderr[-300:]}"), flush=True)
print(f"resumed {ok}/20 | kills that left a temporary {leftovers_seen}")
shutil.rmtree(work)
sys.exit(0 if ok == 20 else 1)
