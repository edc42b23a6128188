"""Stage 05 under torchrun: data-parallel GRPO on 2 CPU processes (gloo) against 1 process.

The equivalence test samples real rollouts from a random micro model once, then gives the same rows
to one process (all groups) and to two torchrun ranks (each its share of whole groups) and compares
the adapters after the update. It uses SGD as well as AdamW because AdamW's first step is nearly
lr * sign(gradient): a gradient off by a constant factor (a mean where a sum belongs) would pass.
This file is also the worker torchrun starts: `python -m torch.distributed.run ... test_distributed.py`.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # when torchrun runs this file as the worker
    sys.path.insert(0, ROOT)

grpo = importlib.import_module("qerl.train")
from qerl import distributed  # noqa: E402  (the engine module beneath 05)
from qerl import hf_files  # noqa: E402
rollout = importlib.import_module("qerl.rollout")
lora = importlib.import_module("qerl.lora")

G = 4  # samples per group
# (name, qerl/train.py flags, optimizer, number of groups, index of a group whose rewards are all equal)
CASES = [
    ("token-mean", ["--loss-agg", "token-mean"], "sgd", 2, None),
    ("seq-mean-token-mean", ["--loss-agg", "seq-mean-token-mean"], "sgd", 2, None),
    ("seq-mean-token-sum-norm", ["--loss-agg", "seq-mean-token-sum-norm"], "sgd", 2, None),
    ("global-norm-clipping", ["--grad-clip", "1e-2"], "sgd", 2, None),
    # rank 0's only group has no signal: it trains on nothing but must still join every collective
    ("idle-rank-mu2-kl", ["--mu", "2", "--beta", "0.05"], "sgd", 2, 0),
    ("adamw-uneven-3-groups", [], "adamw", 3, None),
]


def micro_model(lora_seed=0):
    """A random 2-layer model with a trained-looking adapter (B != 0, so A gets gradients too)."""
    tok = hf_files.byte_tokenizer()
    model = rollout.random_model(tok, seed=0)
    lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(lora_seed))
    gen = torch.Generator().manual_seed(lora_seed + 1)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, tok


def make_rows(model, tok, n_groups, flat_group, seed):
    """Real samples of n_groups prompts x G, with ragged lengths (one row empty), hand-set rewards and
    a perturbed pi_old (so that some tokens are clipped)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [tok.encode(f"{10 + i}+{3 * i}=?") for i in range(n_groups)]
    ro = rollout.generate(model, prompts, num_samples=G, max_new_tokens=10, temperature=1.0,
                          eos_token_ids=[], generator=gen)
    ids, mask = ro.completion_ids.clone(), ro.completion_mask.float().clone()  # (N, T)
    lengths = torch.randint(1, ids.shape[1] + 1, (ids.shape[0],), generator=gen)  # (N,)
    lengths[1] = 0  # an empty completion (only the seq-mean aggregation must skip it)
    cut = torch.arange(ids.shape[1])[None, :] >= lengths[:, None]  # (N, T)
    mask[cut] = 0.0
    ids[cut] = 0
    old_logp = ro.logprobs.float() + 0.3 * torch.randn(ids.shape, generator=gen)  # (N, T)
    rewards = torch.tensor([1.1, 0.0, 0.1, 1.0, 0.0, 1.1, 1.1, 0.1, 1.0, 0.0, 0.0, 0.1][:n_groups * G])  # (N,)
    if flat_group is not None:
        rewards[flat_group * G:(flat_group + 1) * G] = 1.0
    return {"prompt_ids": ro.prompt_ids, "ids": ids, "mask": mask, "old_logp": old_logp * mask, "rewards": rewards}


def run_case(name, flags, optimizer, rows, rank=0, world=1):
    """One policy_update on this rank's share of the groups -> (adapter after, the update's report)."""
    model, _ = micro_model()
    params = lora.lora_parameters(model)
    args = grpo.build_parser().parse_args(["--group", str(G), "--max-new-tokens", "10", "--grad-clip", "1e9",
                                           *flags])
    opt = torch.optim.SGD(params, lr=0.5) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2)
    n_groups = rows["ids"].shape[0] // G
    mine = distributed.shard(list(range(n_groups)), rank, world)
    r = [g * G + j for g in mine for j in range(G)]
    report = grpo.policy_update(model, opt, params, [rows["prompt_ids"][i] for i in r], rows["ids"][r],
                                rows["mask"][r], rows["old_logp"][r], rows["rewards"][r], **grpo.update_options(args))
    return [p.detach().clone() for p in params], report


def worker(case_file, out_dir):
    rank, world, _ = distributed.init("cpu")
    cases = torch.load(case_file, weights_only=True)
    results = {name: run_case(name, flags, optimizer, rows, rank, world) for name, flags, optimizer, rows in cases}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    distributed.leave()


def torchrun(*argv, nproc=2, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, f"torchrun failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_two_ranks_take_the_same_step_as_one_process(tmp_path):
    model, tok = micro_model()
    cases = [(name, flags, optimizer, make_rows(model, tok, n_groups, flat, seed=i))
             for i, (name, flags, optimizer, n_groups, flat) in enumerate(CASES)]
    torch.save(cases, tmp_path / "cases.pt")
    torchrun(os.path.abspath(__file__), tmp_path / "cases.pt", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    before = [p.detach().clone() for p in lora.lora_parameters(model)]
    for name, flags, optimizer, rows in cases:
        want, report = run_case(name, flags, optimizer, rows)
        assert report["skipped"] == "" and report["grad_norm"] > 0, name
        moved = max(float((w - b).abs().max()) for w, b in zip(want, before))
        assert moved > 1e-4, f"{name}: the update is too small to compare"
        for rank in range(2):
            got, got_report = ranks[rank][name]
            # AdamW divides by |gradient|: where that is near its eps, summation-order rounding is
            # amplified up to ~1e-4 of lr; SGD's update is the gradient itself, held to fp32 rounding
            atol = 1e-5 if optimizer == "adamw" else 1e-7
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=atol, msg=lambda m: f"{name}, rank {rank}: {m}")
            for key in ("loss", "grad_norm", "clip", "kl_old", "kl"):  # the logged numbers are global too
                assert got_report[key] == pytest.approx(report[key], rel=1e-5, abs=1e-8, nan_ok=True), (name, key)
        for a, b in zip(ranks[0][name][0], ranks[1][name][0]):  # the ranks hold identical adapters
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ranks[0]["global-norm-clipping"][1]["grad_norm"] > 1e-2  # the clip really acted
    assert ranks[1]["idle-rank-mu2-kl"][1]["kept_rows"] == G and ranks[0]["idle-rank-mu2-kl"][1]["kept_rows"] == 0


def test_torchrun_run_prints_once_checkpoints_and_resumes_on_one_process(tmp_path, capsys):
    out = tmp_path / "dp"
    common = ["--batch", "3", "--group", "4", "--max-new-tokens", "40", "--eval-size", "4", "--eval-k", "0",
              "--save-every", "0", "--time-budget", "0", "--device", "cpu", "--warmup", "1", "--lr", "5e-3"]
    stdout = torchrun("qerl/train.py", "--steps", "3", "--stop-at", "2", "--out", out, *common)
    assert sum(line.startswith("run |") for line in stdout.splitlines()) == 1  # rank 0 alone prints
    assert "ranks 2" in stdout and sum(line.startswith("step ") for line in stdout.splitlines()) == 2
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval" not in r] == [1, 2]
    assert [r["eval"]["step"] for r in rows if "eval" in r] == [0]
    assert {"adapter_model.safetensors", "trainer_state.pt"} <= set(os.listdir(out / "checkpoint-000002"))
    assert sorted(os.listdir(tmp_path)) == ["dp"]  # no other rank wrote a run folder
    # a 2-rank checkpoint resumes on 1 process (the global batch does not depend on the rank count)
    assert json.load(open(out / "args.json"))["world_size"] == 2
    summary = grpo.train(grpo.build_parser().parse_args(["--resume", str(out), "--quiet", "--time-budget", "0"]))
    assert summary["steps_done"] == 3 and summary["final_eval"]["step"] == 3
    assert "note | resuming a run of 2 rank(s) on 1:" in capsys.readouterr().out  # another stream: said so
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval" not in r] == [1, 2, 3]
    for r in rows:
        if "eval" not in r:
            assert 0.0 <= r["reward"] <= 1.1 and 0.0 <= r["frac_zero_std"] <= 1.0 and r["len"] > 0


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_under_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path, signame):
    """Ctrl-C in a terminal signals the whole foreground group, and Slurm every process of a job: launcher
    and ranks, and torchrun passes the signal on (a second one a moment later, the same request). The
    ranks agree (an all-reduce) to stop after the same step; rank 0 checkpoints and prints the resume
    line. torchrun then exits non-zero with its own SignalException report, which is the launcher's."""
    import signal
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "qerl/train.py",
           "--steps", "60", "--batch", "4", "--group", "2", "--max-new-tokens", "12", "--eval-size", "0",
           "--save-every", "0", "--time-budget", "0", "--device", "cpu", "--warmup", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    for line in p.stdout:
        if line.startswith("step 3/"):
            break
    os.killpg(p.pid, getattr(signal, signame))
    _, err = p.communicate(timeout=120)
    summary = json.load(open(out / "summary.json"))
    stopped, said_as = ("interrupt", "interrupted") if signame == "SIGINT" else (signame, f"interrupted ({signame})")
    assert summary["stopped_by"] == stopped and 3 <= summary["steps_done"] < 60, err[-2000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == \
        [f"checkpoint-{summary['steps_done']:06d}"]
    said = sorted(line for line in err.splitlines() if line.startswith("interrupted"))  # rank 1: the bare words
    resume = (f"{said_as} | checkpoint-{summary['steps_done']:06d} saved: continue with  python qerl/train.py "
              f"--resume {out}")
    assert said == [said_as, resume], err[-2000:]


def test_shards_are_whole_contiguous_and_balanced():
    items = list(range(7))
    for world in (1, 2, 3, 7):
        parts = [distributed.shard(items, r, world) for r in range(world)]
        assert sum(parts, []) == items  # every group once, in order
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_fewer_prompts_than_ranks_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "init", lambda device, timeout_s=600.0: (0, 4, "cpu"))  # as if torchrun started 4
    args = grpo.build_parser().parse_args(["--batch", "2", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match=r"--batch 2 is smaller than the number of ranks \(4\)"):
        grpo.train(args)
    assert not (tmp_path / "o").exists()  # nothing written


def faulty_rank(how, at_step, argv):
    """05's command line, with rank 1 failing at its update of step `at_step`: it hangs ("freeze") or dies
    without a word ("die", as kill -9 would)."""
    import time
    cli = importlib.import_module("qerl.cli")
    real, calls = grpo.policy_update, []

    def update(*a, **kw):
        calls.append(1)
        if int(os.environ["RANK"]) == 1 and len(calls) == at_step:
            if how == "die":
                os._exit(9)
            time.sleep(3600)
        return real(*a, **kw)

    grpo.policy_update = update
    code = cli.run_cli(grpo.main, argv)
    distributed.leave(code)


@pytest.mark.parametrize("how", ["freeze", "die"])
def test_a_stuck_or_dead_rank_ends_the_job_with_one_line(tmp_path, how):
    """Rank 1 hangs (or dies) at step 3: rank 0 waits no longer than --dist-timeout (here 12 s, not gloo's
    hours), says in one line which rank went missing at which step, and the job ends non-zero. args.json
    records the rank count; checkpoint-000002 stays."""
    import time
    out = tmp_path / "dp"
    t0 = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log-dir", str(tmp_path / "logs"), "--redirects", "2",  # each rank's stderr in a file of its own
           "tests/test_distributed.py", "--faulty", how, "3", "--steps", "6", "--batch", "2", "--group", "2",
           "--max-new-tokens", "8", "--eval-size", "0", "--save-every", "1", "--time-budget", "0", "--device", "cpu",
           "--dist-timeout", "0.2", "--quiet", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and time.time() - t0 < 180
    rank0 = open(next((tmp_path / "logs").rglob("0/stderr.log"))).read()
    said = [line for line in rank0.splitlines() if line.strip()]
    assert len(said) == 1, rank0[-3000:]  # one line: no gloo message, no traceback
    what = "did not answer within --dist-timeout" if how == "freeze" else "closed its connection: it died"
    assert said[0].startswith("error: step 3: rank 0: rank 1 ") and what in said[0], said[0]
    assert json.load(open(out / "args.json"))["world_size"] == 2
    assert (out / "checkpoint-000002").is_dir() and not (out / "checkpoint-000003").exists()


if __name__ == "__main__":
    if sys.argv[1] == "--faulty":
        faulty_rank(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        worker(sys.argv[1], sys.argv[2])
