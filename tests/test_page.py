"""The page's limits (issue 46): Part 1 of each stage is the paper's path, short enough to read.

Part 1 is every line of a stage above its Part 2 banner (a comment line naming "Part 2"). Limits: each stage
file <= 600 lines; Part 1 <= 1,100 lines in all; 05's Part 1 <= 300; no Part 1 line over 100 characters;
Part 1 names at most 5 of its own file's Part 2 functions.

    python tests/test_page.py   # prints each stage's counts
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = sorted(f for f in os.listdir(ROOT) if re.fullmatch(r"0\d_\w+\.py", f))
BANNER = re.compile(r"^# =+ Part 2\b")
MAX_FILE, MAX_PART1_ALL, MAX_PART1_05, MAX_LINE, MAX_PART2_NAMED = 600, 1100, 300, 100, 5


def split(name):
    """-> (Part 1's lines, Part 2's lines) of a stage."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if BANNER.match(line)]
    assert len(starts) == 1, f"{name}: want one Part 2 banner ('# ===... Part 2 ...'), found {len(starts)}"
    return lines[:starts[0]], lines[starts[0]:]


def part2_functions_named_in_part1(name):
    """The top-level functions (and classes) defined in Part 2 that Part 1's code names."""
    part1, part2 = split(name)
    defined = {n.name for n in ast.parse("\n".join(part2)).body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    tree = ast.parse("\n".join(part1))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    parameters = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}  # a parameter's name is its own
    return sorted(defined & used - parameters)


def test_there_are_five_stages():
    assert STAGES == ["01_quantize.py", "02_lora.py", "03_rollout.py", "04_aqn.py", "05_grpo.py"]


@pytest.mark.parametrize("name", STAGES)
def test_stage_file_within_600_lines(name):
    part1, part2 = split(name)
    assert len(part1) + len(part2) <= MAX_FILE, f"{name}: {len(part1) + len(part2)} lines"


def test_part1_within_1100_lines_in_all_and_05_within_300():
    sizes = {name: len(split(name)[0]) for name in STAGES}
    assert sum(sizes.values()) <= MAX_PART1_ALL, sizes
    assert sizes["05_grpo.py"] <= MAX_PART1_05, sizes


@pytest.mark.parametrize("name", STAGES)
def test_no_part1_line_over_100_characters(name):
    long = [(i + 1, len(line)) for i, line in enumerate(split(name)[0]) if len(line) > MAX_LINE]
    assert not long, f"{name}: Part 1 lines over {MAX_LINE} characters (line, length): {long}"


@pytest.mark.parametrize("name", STAGES)
def test_part1_names_at_most_5_part2_functions(name):
    named = part2_functions_named_in_part1(name)
    assert len(named) <= MAX_PART2_NAMED, f"{name}: Part 1 names {named}"


if __name__ == "__main__":
    total = 0
    for name in STAGES:
        part1, part2 = split(name)
        total += len(part1)
        long = sum(len(line) > MAX_LINE for line in part1)
        print(f"{name} | lines {len(part1) + len(part2)} | part1 {len(part1)} | part1 lines > {MAX_LINE}: {long} | "
              f"part 2 named in part 1: {', '.join(part2_functions_named_in_part1(name)) or '-'}")
    print(f"part 1 in all: {total}")
