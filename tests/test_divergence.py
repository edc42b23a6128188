"""The free divergence alarm (qerl.runs.entropy_jump): a step whose sampler entropy rises far above its recent
median ends the run as diverged, in one line naming the flag to lower; no committed run would have tripped it."""

import glob
import io
import json
import os
import tarfile

import pytest

from qerl import cli, runs
from qerl import train as grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-qwen")


def committed_entropies():
    """{pack/run: [entropy per step]} of every run in bench/results/*/runs.tar.xz."""
    found = {}
    for pack in sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*", "runs.tar.xz"))):
        with tarfile.open(pack) as tar:
            for m in tar.getmembers():
                if m.name.endswith("metrics.jsonl"):
                    lines = io.TextIOWrapper(tar.extractfile(m)).read().splitlines()
                    ents = [r.get("entropy") for r in map(json.loads, lines) if "step" in r]
                    found[f"{os.path.basename(os.path.dirname(pack))}/{m.name}"] = [e for e in ents if e is not None]
    return found


def test_no_committed_run_trips_the_alarm():
    """The default pack, the 750-step and ablation studies of the bundled model and SmolLM2's Table-1 studies:
    the alarm reads each run's entropies as RunLog.step does and never fires."""
    found = committed_entropies()
    assert any(k.startswith("default/") for k in found) and any(k.startswith("smollm2") for k in found)
    assert sum(map(len, found.values())) > 30_000, "the committed packs hold fewer steps than when measured"
    for name, ents in found.items():
        for t in range(1, len(ents)):
            assert runs.entropy_jump(ents[max(0, t - runs.ENTROPY_WINDOW):t], ents[t]) is None, (name, t)


@pytest.mark.parametrize("recent, entropy, trips", [
    ([0.1] * 5, 3.1, True),        # --lr 3e4 on the bundled model: 0.1 -> 3.1 nats
    ([0.1], 1.2, True),            # one step of history is enough
    ([0.1] * 5, 1.05, False),      # a rise of less than ENTROPY_JUMP_NATS
    ([0.9] * 5, 2.5, False),       # 1.6 nats up, but under 3x the median (a high-entropy model)
    ([], 5.0, False),              # no history: nothing to compare with
    ([0.1] * 5, float("nan"), False),  # a non-finite entropy is the finiteness check's, not this alarm's
])
def test_the_alarm_needs_both_a_large_rise_and_a_large_ratio(recent, entropy, trips):
    assert (runs.entropy_jump(recent, entropy) is not None) == trips


def test_a_wrecking_learning_rate_ends_in_one_line_naming_the_divergence(tmp_path, capsys):
    """--lr 3e4: the first update wrecks the policy; the second step's entropy trips the alarm, and the run
    stops with exit 1, one error line naming the entropy and --lr, and no summary.json."""
    out = tmp_path / "run"
    code = cli.run_cli(grpo.main, ["--model", TINY, "--lr", "3e4", "--steps", "6", "--batch", "4", "--group", "4",
                                   "--eval-size", "8", "--eval-k", "0", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "entropy jumped" in err[0] and "diverged" in err[0] and "--lr (now 30000)" in err[0]
    assert not (out / "summary.json").exists()
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step"' in line]
    assert records[-1]["diverged"].startswith("the sampler's entropy jumped") and len(records) < 6
