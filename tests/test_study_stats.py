"""bench/study_stats.py beyond Welch's t: the exact permutation p over seeds, Holm's adjustment over a
study's questions, the minimum detectable effect, the verdict they allow, and the paired bootstrap over
problems and seeds (issue 55). Hand-computed cases, a t table, and simulations with fixed seeds."""
import importlib
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
stats, report = importlib.import_module("study_stats"), importlib.import_module("study_report")


def test_the_permutation_p_counts_every_relabeling():
    # 3 vs 3 fully separated: of the C(6, 3) = 20 splits only the observed one and its mirror are as extreme
    sep = stats.permutation_p([4.0, 5.0, 6.0], [1.0, 2.0, 3.0])
    assert sep == {"p": 2 / 20, "floor": 2 / 20, "relabelings": 20, "exact": True}
    # by hand: a = {1, 2}, b = {3, 4, 5}; a split whose a-side sums to s has diff (5s - 30) / 6, observed
    # -2.5, so |diff| >= 2.5 only for s <= 3 ({1, 2}) or s >= 9 ({4, 5}): 2 of the C(5, 2) = 10 splits
    assert stats.permutation_p([1, 2], [3, 4, 5])["p"] == pytest.approx(2 / 10)
    assert stats.permutation_p([1, 3], [2, 4, 5])["p"] == pytest.approx(4 / 10)  # s <= 4 or s >= 8: {1,2} {1,3} {3,5} {4,5}
    # 6 vs 6 separated (the dynamic-sampling study's final greedy): 2 / 924
    assert stats.permutation_p(range(7, 13), range(1, 7))["p"] == pytest.approx(2 / 924)
    assert stats.permutation_p([1.0] * 3, [1.0] * 3)["p"] == 1.0  # no difference: every split is as extreme
    # splits as extreme as the observed one in exact arithmetic count, whatever the float sums' last bits
    # (0.1 + 0.2 != 0.3 in binary): |diff| 0.1 for {0.1, 0.3} and {0.2, 0.0}, 0.2 for {0.1, 0.0} and {0.2, 0.3}
    assert stats.permutation_p([0.1, 0.3], [0.2, 0.0])["p"] == pytest.approx(4 / 6)


def test_holm_adjusts_a_known_list():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> kept monotone: 0.06 for the last
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = stats.holm([0.5, None, 0.6])  # None is not tested: m = 2; 0.5 x 2 = 1.0 caps and carries
    assert out[1] is None and out[0] == pytest.approx(1.0) and out[2] == pytest.approx(1.0)
    assert stats.holm([0.04]) == [0.04] and stats.holm([]) == []


@pytest.mark.parametrize("q, df, t", [(0.975, 5, 2.5706), (0.8, 10, 0.8791), (0.975, 10, 2.2281), (0.8, 5, 0.9195)])
def test_the_t_quantile_matches_a_t_table(q, df, t):
    assert stats.t_quantile(q, df) == pytest.approx(t, abs=1e-4)


def test_the_minimum_detectable_effect_is_the_t_approximation_and_holds_its_power():
    # by hand: se 1, df 10 -> t_0.975 + t_0.8 = 2.2281 + 0.8791
    assert stats.detectable(1.0, 10) == pytest.approx(3.1072, abs=1e-4)
    assert stats.detectable(None, None) is None
    # brute force: 6 + 6 seeds of sd 1 with a true difference of the MDE (se sqrt(2/6), df 10) are found by a
    # two-sided t-test at 0.05 in about 80% of 20,000 simulated studies (the approximation is slightly short)
    rng = np.random.default_rng(0)
    se = (2 / 6) ** 0.5
    effect = stats.detectable(se, 10)
    a, b = rng.normal(effect, 1, (20_000, 6)), rng.normal(0, 1, (20_000, 6))
    t = (a.mean(1) - b.mean(1)) / np.sqrt(a.var(1, ddof=1) / 6 + b.var(1, ddof=1) / 6)
    power = float((np.abs(t) > stats.t_quantile(0.975, 10)).mean())
    assert 0.76 < power < 0.82, power


def seed_records(values):
    """Minimal run records {method: [final greedy per seed]} for answers()."""
    return [{"method": m, "seed": s, "final_greedy": v, "eval_n": 4} for m, vs in values.items() for s, v in enumerate(vs)]


def contrast(values, a="a", b="b"):
    records = seed_records(values)
    summary = {m: {"final_greedy": stats.mean_std(vs), "start_greedy": (0.2, 0.0, len(vs)), "k": None,
                   "final_pass_k": (0, 0, 0), "entropy_first_fifth": (0, 0, 0)} for m, vs in values.items()}
    return stats.answers(summary, records, [(a, b, "q")])[0]["final_greedy"]


def test_a_ranking_needs_the_adjusted_p_and_otherwise_says_what_the_seeds_could_see():
    # 3 vs 3, 3 points apart (t -3.67, df 4): Welch's p 0.021, but the permutation p cannot go below 0.10
    w = contrast({"a": [0.40, 0.41, 0.42], "b": [0.37, 0.38, 0.39]})
    assert w["p"] == pytest.approx(0.0213, abs=1e-4) and w["p_permutation"] == pytest.approx(0.1) and w["p_holm"] == pytest.approx(0.1)
    assert w["verdict"].startswith("not distinguishable; the seeds could have detected a difference of about ")
    assert "none under this rule (3 + 3 seeds: the permutation p cannot go below 0.10)" in w["verdict"]
    # 6 vs 6 separated: 2/924 ranks
    w = contrast({"a": [0.40 + i / 1000 for i in range(6)], "b": [0.37 + i / 1000 for i in range(6)]})
    assert w["p_permutation"] == pytest.approx(2 / 924) and w["verdict"] == "a ends higher than b"
    # 6 vs 6 overlapping: not distinguishable, with the MDE (no floor clause: 6 seeds could rank)
    w = contrast({"a": [0.40, 0.36, 0.41, 0.38, 0.35, 0.39], "b": [0.37, 0.39, 0.36, 0.40, 0.38, 0.35]})
    assert w["verdict"] == f"not distinguishable; the seeds could have detected a difference of about {w['mde']:.1f} points"
    assert w["mde"] == pytest.approx(stats.detectable(w["se"], w["df"]))
    assert "Welch's t p" in report.contrast_text(w) and "Holm-adjusted p" in report.contrast_text(w, verdict=True)


def test_the_committed_dynamic_sampling_question_carries_every_statistic():
    """The numbers issue 55 recomputed by hand: +2.55 [+1.22, +3.88], Welch p 0.0032, exact permutation p 2/924
    (every refilling seed ends above every default seed), MDE 1.8 points."""
    with open(os.path.join(ROOT, "bench", "results", "dynamic-sampling", "results.json")) as fh:
        q = json.load(fh)["questions"][0]["final_greedy"]
    assert q["diff"] == pytest.approx(2.55) and q["p"] == pytest.approx(0.0032, abs=1e-4)
    assert q["p_permutation"] == pytest.approx(2 / 924) and q["relabelings"] == 924
    assert q["p_holm"] == pytest.approx(2 / 924) and q["family"] == 1
    assert q["mde"] == pytest.approx(1.82, abs=0.01) and q["verdict"] == "qerl-ds2 ends higher than qerl"


def outcomes(rng, seeds, problems, rate):
    return (rng.random((seeds, problems)) < rate).astype(np.uint8)


def test_the_paired_bootstrap_finds_a_known_subset_and_centres_identical_arms_on_zero():
    rng = np.random.default_rng(1)
    base = outcomes(rng, 6, 1000, 0.4)
    better = base.copy()
    better[:, :100] = 1  # arm a is right on the first 100 problems in every seed: +100 x 0.6 / 1000 ~ +6 points
    diff = 100 * (better.mean() - base.mean())
    b = stats.paired_bootstrap(better, base, replicates=4000)
    # each arm's seeds are drawn within it: a seed's accuracy on 1000 problems at 40% scatters by ~1.5 points
    assert b["diff"] == pytest.approx(diff) and 5 < diff < 7
    assert b["ci"][0] > 0 and b["ci"][0] < diff < b["ci"][1] and b["p"] < 0.001
    assert b["seeds"] == [6, 6] and b["problems"] == 1000 and b["replicates"] == 4000
    assert stats.paired_bootstrap(better, base, replicates=4000) == b  # a fixed seed: the same numbers
    # identical arms, and two arms drawn alike: intervals around 0, no small p
    for a2, b2 in ((base, base), (outcomes(rng, 6, 1000, 0.4), outcomes(rng, 6, 1000, 0.4))):
        same = stats.paired_bootstrap(a2, b2, replicates=4000)
        assert same["ci"][0] < 0 < same["ci"][1] and same["p"] > 0.05
    with pytest.raises(ValueError, match="same problems"):
        stats.paired_bootstrap(base, base[:, :10])


def test_a_study_gives_the_paired_comparison_only_where_every_run_kept_its_outcomes():
    rng = np.random.default_rng(2)
    rows = {"a": outcomes(rng, 3, 50, 0.6), "b": outcomes(rng, 3, 50, 0.4)}
    values = {m: [float(r.mean()) for r in rows[m]] for m in rows}
    records = seed_records(values)
    for r in records:
        r["eval_n"] = 50
        r["final_outcomes"] = "".join(map(str, rows[r["method"]][r["seed"]]))
    summary = {m: {"final_greedy": stats.mean_std(vs), "start_greedy": (0.2, 0.0, 3), "k": None,
                   "entropy_first_fifth": (0, 0, 0)} for m, vs in values.items()}
    q = stats.answers(summary, records, [("a", "b", "q")])[0]
    assert q["paired"]["diff"] == pytest.approx(q["final_greedy"]["diff"]) and q["paired"]["problems"] == 50
    assert "paired over 50 problems x seeds" in report.paired_text(q) and "bootstrap p" in report.paired_text(q)
    records[0]["final_outcomes"] = None  # one run without them: no paired comparison
    assert "paired" not in stats.answers(summary, records, [("a", "b", "q")])[0]
    records[0]["final_outcomes"] = "01"  # not one character per problem: one line naming the run
    with pytest.raises(ValueError, match=r"a-s0: final_outcomes is not 50 characters of 0 and 1"):
        stats.answers(summary, records, [("a", "b", "q")])
