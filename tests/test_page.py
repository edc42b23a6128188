"""The five stages stand alone (issue 54): each numbered file imports only the standard library, the design
card's packages and the earlier stages (01 also kernels/), is what `ruff format` writes, and fits its limit;
the top level holds no other Python; the trainer (qerl/) imports the stages and never the reverse.

Limits: each stage <= 500 lines, 05 <= 450 with <= 20 flags, the five <= 2,000.

    python tests/test_page.py   # prints each stage's lines, imports and 05's flags
"""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["01_quantize.py", "02_lora.py", "03_rollout.py", "04_aqn.py", "05_grpo.py"]
MAX_STAGE, MAX_05, MAX_ALL, MAX_05_FLAGS = 500, 450, 2000, 20
PACKAGES = {"torch", "numpy", "safetensors", "tokenizers", "triton"}  # the design card's


def source(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def imports(name):
    """-> (top-level names of `import`/`from` statements, modules named by importlib.import_module("...")), for
    every import in the file, at any depth."""
    tree = ast.parse(source(name))
    plain, by_name = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            plain |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            plain.add("." if node.level else node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            by_name.add(node.args[0].value)
    return plain, by_name


def flags(name):
    """The option strings of every add_argument call in the file."""
    found = []
    for node in ast.walk(ast.parse(source(name))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
    return found


def lines(name):
    return len(source(name).splitlines())


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_imports_only_the_standard_library_the_packages_and_earlier_stages(name):
    plain, by_name = imports(name)
    outside = {m for m in plain if m not in sys.stdlib_module_names and m not in PACKAGES}
    if name == "01_quantize.py":
        outside.discard("kernels")  # 01 alone may load kernels/ (by file path)
    assert not outside, f"{name} imports {sorted(outside)}"
    earlier = {s[:-3] for s in STAGES[: STAGES.index(name)]}
    if name == "01_quantize.py":  # kernels/ loaded by its path under a private package name
        by_name = {m for m in by_name if not m.startswith("nvfp4_kernels.")}
    assert by_name <= earlier, f"{name} imports by name {sorted(by_name - earlier)}"
    assert "sys.modules[__name__]" not in source(name)


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_fits_its_limit(name):
    assert lines(name) <= (MAX_05 if name == "05_grpo.py" else MAX_STAGE), (name, lines(name))


def test_the_five_fit_together_and_05_has_few_flags():
    assert sum(map(lines, STAGES)) <= MAX_ALL, {s: lines(s) for s in STAGES}
    assert len(flags("05_grpo.py")) <= MAX_05_FLAGS, flags("05_grpo.py")


def test_the_stages_are_as_ruff_format_writes_them():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in requirements.txt)")
    r = subprocess.run([ruff, "format", "--check", "--no-cache", *STAGES],  # ruff.toml's line length
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_top_level_holds_the_stages_and_no_other_python():
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert top == STAGES, top


def test_the_trainer_never_imports_itself_into_a_stage_and_builds_on_them():
    """qerl/ imports the stages (by name); no stage names qerl (checked above, over every import)."""
    named = set()
    for f in os.listdir(os.path.join(ROOT, "qerl")):
        if f.endswith(".py"):
            named |= imports(os.path.join("qerl", f))[1]
    assert {s[:-3] for s in STAGES} & named, "qerl/ imports no stage"


def test_the_stages_copied_alone_import_and_run(tmp_path):
    """The five stages with kernels/ and the bundled model in an empty folder: each imports (nothing of the
    checkout on sys.path), and 05 trains two steps, evaluates and saves its adapter."""
    for s in STAGES:
        shutil.copy(os.path.join(ROOT, s), tmp_path)
    shutil.copytree(os.path.join(ROOT, "kernels"), tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "assets", "tiny-qwen"), tmp_path / "assets" / "tiny-qwen")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import importlib; [importlib.import_module(m) for m in %r]; import sys; " \
           "assert 'qerl' not in sys.modules" % [s[:-3] for s in STAGES]
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "05_grpo.py", "--steps", "2", "--batch", "2", "--group", "4",
                        "--max-new-tokens", "16", "--eval-size", "4", "--out", "run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    made = set(os.listdir(tmp_path / "run"))
    assert {"metrics.jsonl", "summary.json", "adapter_model.safetensors", "adapter_config.json"} <= made, made


def test_the_readme_counts_are_the_files_counts():
    """The README's reading-path table gives each stage's lines and 05's flags: computed here, not trusted."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for s in STAGES:
        found = re.search(rf"^\| \[`{re.escape(s)}`\]\({re.escape(s)}\) \| (\d+) \|", readme, re.M)
        assert found, f"README.md's reading path has no row for {s}"
        assert int(found.group(1)) == lines(s), f"README.md says {s} has {found.group(1)} lines; it has {lines(s)}"
    found = re.search(r"one log line a step; (\d+) flags", readme)
    assert found and int(found.group(1)) == len(flags("05_grpo.py")), "README.md's count of 05's flags"


if __name__ == "__main__":
    for s in STAGES:
        plain, by_name = imports(s)
        print(f"{s:16s} {lines(s):4d} lines | imports {', '.join(sorted(plain | by_name))}")
    print(f"{'the five':16s} {sum(map(lines, STAGES)):4d} lines | 05's flags: {len(flags('05_grpo.py'))}")
    print("05:", " ".join(re.sub(r"^--", "", f) for f in flags("05_grpo.py")))
