"""bench/same_results.py: what it drops as volatile, how it names a difference, and that a run repeats exactly."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import same_results  # noqa: E402


def test_normalize_drops_clock_machine_and_paths():
    row = {"step": 1, "loss": 0.5, "tok/s": 9.0, "s/step": 0.1, "t_sample": 0.2, "cpu_s": 0.3, "wall_s": 1.0,
           "peak_rss_mb": 400.0, "time": 2.0, "eval": {"greedy": 0.5, "seconds": 0.1},
           "args": {"out": "/tmp/x", "model": "/m", "seed": 2, "time_budget": 0.0}}
    assert same_results.normalize(row) == {"step": 1, "loss": 0.5, "eval": {"greedy": 0.5},
                                           "args": {"seed": 2, "time_budget": 0.0}}


def test_differences_name_the_file_and_first_key():
    want = {"sha256": {"adapter_model.safetensors": "a", "metrics.jsonl": "m"},
            "metrics": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25, "reward": 1.0}]}
    got = {"sha256": {"adapter_model.safetensors": "b", "metrics.jsonl": "n"},
           "metrics": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.3, "reward": 0.0}]}
    diff = same_results.differences(want, got)
    assert diff[0] == "adapter_model.safetensors"
    assert "line[2].loss" in diff[1] and "0.25" in diff[1] and "0.3" in diff[1]


def test_a_config_repeats_exactly(tmp_path):
    runs = [same_results.measure("no-eval", str(tmp_path / str(i))) for i in range(2)]
    assert runs[0]["sha256"] == runs[1]["sha256"]
    assert runs[0]["steps_with_gradient"] > 0  # the adapters moved: their hash proves something


def test_the_checkout_path_is_not_recorded(tmp_path):
    """Two checkouts at other paths record the same run alike: adapter_config.json's base model path (the
    bundled model inside the checkout) is left out of its hash; every other field counts."""
    def fake_run(folder, base, r=16):
        ckpt = folder / "checkpoint-000003"
        ckpt.mkdir(parents=True)
        (ckpt / "adapter_model.safetensors").write_bytes(b"weights")
        (ckpt / "adapter_config.json").write_text(
            json.dumps({"base_model_name_or_path": base, "r": r}))
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
        (folder / "summary.json").write_text(json.dumps({"steps_done": 3}))
        return same_results.record(str(folder))["sha256"]

    a = fake_run(tmp_path / "a", "/one/checkout/assets/tiny-qwen")
    b = fake_run(tmp_path / "b", "/another/assets/tiny-qwen")
    c = fake_run(tmp_path / "c", "/one/checkout/assets/tiny-qwen", r=8)
    assert a == b and a["adapter_config.json"] != c["adapter_config.json"]


def test_a_baseline_from_another_machine_is_named():
    """Floats can round differently on another CPU, so --check says where its baseline was written."""
    here = same_results.machine()
    assert here["cpu"] and here["torch"].split(".")[0].isdigit()
    assert same_results.machine_warning({"machine": dict(here)}, here) is None
    other = dict(here, cpu="Some Other CPU", cpu_flags="amx_bf16 avx512_bf16")
    line = same_results.machine_warning({"machine": other}, here)
    assert "Some Other CPU" in line and here["cpu"] in line and "--write" in line
    assert "does not record" in same_results.machine_warning({}, here)


def test_a_baseline_is_a_line_of_hashes_a_configuration_with_its_details_beside(tmp_path):
    """--write keeps the hashes in FILE (one line per configuration) and the metrics and summaries compressed
    beside it; --check reads both back, so a difference is still named by its first key."""
    results = {name: {"checkpoint": "checkpoint-000003", "steps_with_gradient": 3,
                      "sha256": {"adapter_model.safetensors": name, "metrics.jsonl": "m"},
                      "metrics": [{"step": 1, "loss": 0.5}], "summary": {"steps_done": 3}}
               for name in ("default", "nf4", "resume")}
    path = str(tmp_path / "baseline.json")
    same_results.write_baseline(path, {"commit": "abc", "machine": {"cpu": "x"}}, results)
    lines = open(path).read().splitlines()
    assert len(lines) == 1 + len(results) + 1 and all('"metrics"' not in line for line in lines)
    assert os.path.exists(same_results.details_path(path))
    back = same_results.read_baseline(path)
    assert back["configs"] == results and back["commit"] == "abc"
    got = dict(results["nf4"], sha256={"adapter_model.safetensors": "nf4", "metrics.jsonl": "n"},
               metrics=[{"step": 1, "loss": 0.25}])
    assert "line[1].loss" in same_results.differences(back["configs"]["nf4"], got)[0]


def test_the_committed_baselines_are_lean():
    """Each committed baseline: a header line, a line per configuration, a closing line."""
    folder = os.path.join(same_results.ROOT, "bench", "results", "same_results")
    for name in os.listdir(folder):
        if name.startswith("baseline-") and name.endswith(".json"):
            baseline = same_results.read_baseline(os.path.join(folder, name))
            assert sum(1 for _ in open(os.path.join(folder, name))) == len(baseline["configs"]) + 2
            assert all("metrics" in c for c in baseline["configs"].values())  # the details beside it


def test_a_missing_baseline_or_an_unknown_only_is_one_line(tmp_path, capsys):
    assert same_results.cli.run_cli(same_results.main, ["--check", str(tmp_path / "none.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such baseline" in err[0]
    path = str(tmp_path / "b.json")
    same_results.write_baseline(path, {"commit": "abc"}, {"default": {"sha256": {}}})
    assert same_results.cli.run_cli(same_results.main, ["--check", path, "--only", "nf4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only nf4: not in the baseline" in err[0]
