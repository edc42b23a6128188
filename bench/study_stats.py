"""The statistics of a study (bench/compare_methods.py): per method the mean +- std over seeds and the
collapses; per contrast Welch's t-test over the seeds, its t distribution written out (scipy is not a
dependency), the exact permutation p, Holm's adjustment over the study's questions, the smallest
difference the seeds could detect, a paired bootstrap over problems where the runs kept them, and the
verdict it earns."""
import itertools
import math
import random
import statistics

import numpy as np


# A collapse is told apart from a low score: the run ends below where it started, or its completions
# shrink to a few tokens. Healthy SmolLM2 runs shorten their answers to 32-52% of their first fifth's
# length as they learn the format (48 -> ~10 tokens); the one collapsed run (smollm2-table1 qerl-s2) went
# to 9%, to 2-3 tokens. A quarter sits between the two with room on both sides.
COLLAPSE_LEN = 0.25


def collapse(start, final, len_first, len_last):
    """Why a run collapsed (a short phrase), or None: it ended below its start greedy accuracy, or its
    completions' mean length over the last fifth of the steps fell under COLLAPSE_LEN of the first fifth's."""
    why = []
    if final < start:
        why.append(f"ended below its start ({100 * final:.1f}% < {100 * start:.1f}%)")
    if len_first and len_last is not None and len_last < COLLAPSE_LEN * len_first:
        why.append(f"completions shrank to {len_last:.1f} tokens from {len_first:.1f}")
    return "; ".join(why) or None


# ---------------------------------------------------------------------------------------------------
# Summaries: per-method mean +- std over seeds, and the paper's ordering


def mean_std(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return float("nan"), float("nan"), 0
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0), len(values)


def summarize(records, methods):
    out = {}
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        stt = [r["steps_to_threshold"] for r in rs]
        out[m] = {"label": rs[0]["label"], "runs": len(rs), "seeds": [r["seed"] for r in rs],
                  "start_greedy": mean_std([r["start_greedy"] for r in rs]),
                  "final_greedy": mean_std([r["final_greedy"] for r in rs]),
                  "gain_points": mean_std([r["gain_points"] for r in rs]),
                  "final_pass_k": mean_std([r["final_pass_k"] for r in rs]),
                  "start_pass_k": mean_std([r["start_pass_k"] for r in rs]),
                  "steps_to_threshold": mean_std([s for s in stt if s is not None]),
                  "reached": sum(s is not None for s in stt),
                  "entropy_first_fifth": mean_std([r["entropy_first_fifth"] for r in rs]),
                  "entropy_last_fifth": mean_std([r["entropy_last_fifth"] for r in rs]),
                  "kl_old": mean_std([r.get("kl_old") for r in rs]), "clip": mean_std([r.get("clip") for r in rs]),
                  **{key: mean_std([r.get(key) for r in rs]) for key in ("mismatch_kl", "is_beyond_cap", "grad_norm")},
                  "s_per_step": mean_std([r["s_per_step"] for r in rs]),
                  "steps_taken": mean_std([r["steps"] for r in rs]),
                  "completions": mean_std([r.get("completions") for r in rs]),
                  "wall_s": mean_std([r["wall_s"] for r in rs]), "k": rs[0]["k"],
                  # counted apart from the mean: one collapsed seed drags a mean of 3 without moving the others
                  "collapses": sum(bool(r.get("collapse")) for r in rs),
                  "collapsed_seeds": [r["seed"] for r in rs if r.get("collapse")]}
    return out


# Welch's t-test over seeds. At 3 seeds a side the test has 2-4 degrees of freedom: a difference must be
# 2.8-4.3 of its standard errors to reach p < 0.05, not the 2 a normal approximation asks. scipy is not a
# dependency, so the t distribution is written out here: its tail is a regularized incomplete beta.
ALPHA = 0.05


def betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz),
    taken on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    return betainc(df / 2, 0.5, df / (df + t * t))


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = t_two_sided_p(t, df) / 2
    return 1.0 - tail if t > 0 else tail


def t_quantile(q, df):
    """The t with P(T <= t) = q (0 < q < 1), by bisection on t_cdf (monotone)."""
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def welch(ma, sa, na, mb, sb, nb, level=1 - ALPHA):
    """Welch's t-test of mean a - mean b from each side's mean, sample std and count: {diff, se, df, t,
    ci: [lo, hi] at `level`, p (two-sided)}. With fewer than 2 values on a side, or no spread on either
    (no variance to judge by), only diff is known: the rest is None and the verdict can only be "not
    distinguishable"."""
    diff = ma - mb
    out = {"diff": diff, "se": None, "df": None, "t": None, "ci": None, "p": None}
    if min(na, nb) < 2:
        return out
    va, vb = sa ** 2 / na, sb ** 2 / nb
    se = math.sqrt(va + vb)
    if se == 0:
        return out
    df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return {**out, "se": se, "df": df, "t": diff / se, "ci": [diff - half, diff + half],
            "p": t_two_sided_p(diff / se, df)}


# ---------------------------------------------------------------------------------------------------
# What the seeds can say beyond Welch's p: the exact permutation p, Holm's adjustment over a study's
# questions, the smallest difference the seeds could have detected, and the verdict these allow

POWER = 0.8
EXACT_LIMIT = 200_000  # relabelings enumerated (10 + 10 seeds: 184,756); beyond it a fixed-seed sample
SAMPLED_RELABELINGS, PERMUTATION_SEED = 100_000, 0


def permutation_p(a, b):
    """Two-sided permutation p of mean(a) - mean(b) over seeds: the share of the C(na + nb, na) ways to
    split the pooled values into na and nb whose |difference of means| is at least the observed one (the
    observed split among them). Every split is enumerated (beyond EXACT_LIMIT a fixed-seed sample, with
    (1 + count) / (1 + draws)). It assumes only that the seeds' labels are exchangeable when the methods
    do not differ. With 3 seeds a side it cannot go below 2/20 = 0.10: the mirrored split is as extreme.
    Returns {"p", "floor" (the smallest p these values could give: the most extreme split's), "relabelings",
    "exact"}; p None when a side has no value."""
    a, b = list(a), list(b)
    if not a or not b:
        return {"p": None, "floor": None, "relabelings": 0, "exact": True}
    pooled, na, nb = a + b, len(a), len(b)
    total, observed = sum(pooled), abs(sum(a) / na - sum(b) / nb)
    # a split summed in another order differs in its last bits: such ties count as at least as extreme
    tol = 1e-9 * max(1.0, max(abs(v) for v in pooled))

    def spread(sum_a):
        return abs(sum_a / na - (total - sum_a) / nb)

    n = math.comb(na + nb, na)
    if n <= EXACT_LIMIT:
        spreads = [spread(sum(pooled[i] for i in split)) for split in itertools.combinations(range(na + nb), na)]
        widest = max(spreads)
        return {"p": sum(d >= observed - tol for d in spreads) / n,
                "floor": sum(d >= widest - tol for d in spreads) / n, "relabelings": n, "exact": True}
    rng = random.Random(PERMUTATION_SEED)
    hits = sum(spread(sum(rng.sample(pooled, na))) >= observed - tol for _ in range(SAMPLED_RELABELINGS))
    return {"p": (1 + hits) / (1 + SAMPLED_RELABELINGS), "floor": 1 / (1 + SAMPLED_RELABELINGS),
            "relabelings": SAMPLED_RELABELINGS, "exact": False}


def holm(ps):
    """Holm's step-down adjustment of a family of p-values, in their order: the i-th smallest of m (i from
    0) is multiplied by m - i, kept from falling below the one before it, and capped at 1. It holds the
    chance of any false ranking in the family at alpha whatever the tests' dependence. A None (a question
    with nothing to test) stays None and does not count in m."""
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out, running = [None] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * ps[i]))
        out[i] = running
    return out


def detectable(se, df, alpha=ALPHA, power=POWER):
    """The minimum detectable effect: the true difference a two-sided test at `alpha` finds with
    probability `power`, from the observed spread, by the two-sample t approximation
        MDE = (t_{1 - alpha/2, df} + t_{power, df}) * se
    with Welch's se and df (the interval's own; the t quantiles invert t_cdf). None where Welch's test has
    no variance."""
    if se is None:
        return None
    return (t_quantile(1 - alpha / 2, df) + t_quantile(power, df)) * se


def distinguishable(w):
    """A ranking needs the family-adjusted p (rank_family) below ALPHA: among a study's questions one
    unadjusted p under 0.05 in twenty comes by chance."""
    return w.get("p_holm") is not None and w["p_holm"] < ALPHA


def verdict(a, b, w, what="ends higher than", unit="points"):
    """The sentence a contrast earns: "a ends higher than b" (or b than a) at Holm-adjusted p < ALPHA,
    else "not distinguishable", with the difference the seeds could have detected where it is known. The
    MDE is the t approximation's; where the adjusted permutation p cannot reach ALPHA at all (3 + 3 seeds:
    0.10 before the adjustment), the sentence says that no difference could rank these seeds."""
    if distinguishable(w):
        return f"{a} {what} {b}" if w["diff"] > 0 else f"{b} {what} {a}"
    if w.get("mde") is None:
        return "not distinguishable"
    text = f"not distinguishable; the seeds could have detected a difference of about {w['mde']:.1f} {unit}"
    floor = w.get("p_floor_holm")
    if floor is not None and floor >= ALPHA:
        family = (f", nor {floor:.2f} adjusted over a family of {w['family']}" if floor > w["p_floor"] + 1e-9
                  else "")
        text += (f" by Welch's t, but none under this rule ({w['seeds'][0]} + {w['seeds'][1]} seeds: the permutation "
                 f"p cannot go below {w['p_floor']:.2f}{family})")
    return text


def seed_values(records, method, key, scale):
    """The per-seed values of `key` for `method` (x scale), the ones mean_std counts."""
    return [scale * r[key] for r in records if r["method"] == method and r.get(key) is not None
            and not (isinstance(r[key], float) and math.isnan(r[key]))]


def difference(summary, records, a, b, key="final_greedy", scale=100):
    """Mean of a minus mean of b on `key` (x scale: points): Welch's interval and p (welch), the exact
    permutation p over the per-seed values and the minimum detectable effect; NaN diff when a side has no
    values."""
    (ma, sa, na), (mb, sb, nb) = summary[a][key], summary[b][key]
    if min(na, nb) == 0:
        return {"diff": float("nan"), "se": None, "df": None, "t": None, "ci": None, "p": None,
                "p_permutation": None, "p_floor": None, "relabelings": 0, "seeds": [na, nb], "mde": None}
    w = welch(scale * ma, scale * sa, na, scale * mb, scale * sb, nb)
    perm = permutation_p(seed_values(records, a, key, scale), seed_values(records, b, key, scale))
    return {**w, "p_permutation": perm["p"], "p_floor": perm["floor"], "relabelings": perm["relabelings"],
            "seeds": [na, nb],
            **({} if perm["exact"] else {"permutation_sampled": True}), "mde": detectable(w["se"], w["df"])}


def rank_family(contrasts):
    """The verdicts of a study's family of questions, on final greedy: Holm's adjustment of their exact
    permutation p (not Welch's: it assumes nothing of how seeds scatter, where Welch's df at 3 seeds is a
    guess) sets each w["p_holm"] and w["family"], then w["verdict"]. contrasts: [(a, b, w)]; a question
    asked twice (the hard study's best level can be 1e-2, which has its own question) is one test. A
    question's adjusted p can go below neither the smallest p its own values could give nor m x the
    smallest any question's could (w["p_floor_holm"]): where that is ALPHA or more, these seeds could not
    rank it whatever the difference."""
    tests, floors = {}, {}
    for a, b, w in contrasts:
        tests.setdefault((a, b), w["p_permutation"])
        floors.setdefault((a, b), w["p_floor"])
    adjusted = dict(zip(tests, holm(list(tests.values()))))
    family = sum(p is not None for p in tests.values())
    known = [f for f in floors.values() if f is not None]
    lowest = min(1.0, family * min(known)) if known else None
    for a, b, w in contrasts:
        floor = None if w["p_floor"] is None else max(w["p_floor"], lowest)
        w.update(p_holm=adjusted[a, b], family=family, p_floor_holm=floor)
        w["verdict"] = verdict(a, b, w)


def compare(summary, records, a, b):
    """The paper's ordering a >= b on final greedy accuracy (difference(), and paired() where the runs kept
    their outcomes); rank_family over the pairs gives the verdicts."""
    if a not in summary or b not in summary:
        return None
    return {"pair": f"{a} >= {b}", "a": a, "b": b, "final_greedy": difference(summary, records, a, b),
            **paired(records, a, b)}


def answer(summary, records, a, b, question):
    """One question of a study: a - b on final greedy (the verdict, once rank_family has seen the family),
    pass@k and first-fifth entropy, each with Welch's and the permutation p; the paired bootstrap over
    problems where every run of both kept its outcomes."""
    if a not in summary or b not in summary:
        return None
    out = {"question": question, "a": a, "b": b}
    for key, scale in (("final_greedy", 100), ("final_pass_k", 100), ("entropy_first_fifth", 1)):
        if key == "final_pass_k" and not summary[a]["k"]:
            continue  # evaluated greedy only (--eval-k 0)
        out[key] = difference(summary, records, a, b, key, scale)
    # where the two bases start apart (bf16 against 4-bit), the same seeds' gain over their own start too: a
    # final-accuracy lead can be the head start alone (read beside the verdict, which stays on final greedy)
    if summary[a]["start_greedy"][0] != summary[b]["start_greedy"][0]:
        out["gain_points"] = difference(summary, records, a, b, "gain_points", 1)
    return {**out, **paired(records, a, b)}


def answers(summary, records, questions):
    """The study's questions [(a, b, text)] answered, the verdicts over the family of those with both
    methods run."""
    out = [q for q in (answer(summary, records, a, b, text) for a, b, text in questions) if q]
    rank_family([(q["a"], q["b"], q["final_greedy"]) for q in out])
    return out


def checks(summary, records, pairs):
    """The paper's ordering and the control [(a, b)], the verdicts over the family of pairs run."""
    out = [c for c in (compare(summary, records, a, b) for a, b in pairs) if c]
    rank_family([(c["a"], c["b"], c["final_greedy"]) for c in out])
    return out


# ---------------------------------------------------------------------------------------------------
# The paired comparison over problems: where every run kept which held-out problems its final greedy
# answer got right (a record's "final_outcomes", '0'/'1' per problem), 1,000 problems count as evidence
# beside the seeds

BOOTSTRAP_REPLICATES, BOOTSTRAP_SEED = 10_000, 0


def outcome_rows(records, method):
    """The 0/1 outcomes of `method`'s runs, one row per seed (a numpy array), or None when a run lacks them;
    a string that is not eval_n characters of 0 and 1 is one line naming the run."""
    rows = []
    for r in sorted((r for r in records if r["method"] == method), key=lambda r: r["seed"]):
        text = r.get("final_outcomes")
        if text is None:
            return None
        if not isinstance(text, str) or len(text) != r["eval_n"] or text.strip("01"):
            raise ValueError(f"{method}-s{r['seed']}: final_outcomes is not {r['eval_n']} characters of 0 and 1 "
                             f"(one per held-out problem): rerun its evaluation, or drop the field")
        rows.append(np.frombuffer(text.encode(), dtype=np.uint8) - ord("0"))
    return np.stack(rows) if rows else None


def draw_counts(rng, replicates, n):
    """How often each of n items is drawn in n draws with replacement, per replicate: (replicates, n) ints."""
    picks = rng.integers(0, n, size=(replicates, n)) + n * np.arange(replicates)[:, None]
    return np.bincount(picks.ravel(), minlength=replicates * n).reshape(replicates, n)


def paired_bootstrap(a, b, replicates=BOOTSTRAP_REPLICATES, seed=BOOTSTRAP_SEED, level=1 - ALPHA, chunk=1000):
    """a - b in mean accuracy (points) over problems and seeds. a, b: 0/1, one row per seed, one column per
    problem (the same problems in the same columns). Each replicate draws the problems once with
    replacement, the same draw for both arms (paired: a problem easy for one is easy for the other), then
    each arm's seeds with replacement within it. Returns diff (the observed), ci (the percentile interval
    at `level`), p (two-sided: twice the smaller share of replicates on either side of 0, as
    (1 + count) / (1 + replicates), at most 1) and the counts. A numpy Generator with a fixed seed (numpy
    vectorizes the replicates): the same numbers every time. It errs wide: a seed's problem-by-problem
    noise is drawn at both levels (on 100 simulated pairs of like arms, 6 seeds x 1000 problems, its 95%
    interval held 0 in 99; 10,000 replicates take about 2 s on one core)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(a.shape[0], b.shape[0], a.shape[1]) == 0:
        raise ValueError(f"paired_bootstrap needs two (seeds, problems) arrays over the same problems, got "
                         f"{a.shape} and {b.shape}")
    rng, problems, diffs = np.random.default_rng(seed), a.shape[1], []
    for start in range(0, replicates, chunk):
        n = min(chunk, replicates - start)
        weight = draw_counts(rng, n, problems) / problems  # (n, problems), the same for both arms
        means = []
        for arm in (a, b):
            per_seed = arm @ weight.T  # (seeds, n): each seed's accuracy on the drawn problems
            means.append((draw_counts(rng, n, arm.shape[0]) * per_seed.T).sum(1) / arm.shape[0])
        diffs.append(100 * (means[0] - means[1]))
    diffs = np.concatenate(diffs)
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    side = min(int((diffs <= 0).sum()), int((diffs >= 0).sum()))
    return {"diff": 100 * float(a.mean() - b.mean()), "ci": [float(lo), float(hi)],
            "p": min(1.0, 2 * (1 + side) / (1 + replicates)), "replicates": replicates,
            "problems": problems, "seeds": [a.shape[0], b.shape[0]]}


def paired(records, a, b):
    """{"paired": paired_bootstrap(...)} where every run of a and of b kept its outcomes on the same number
    of problems, else {}."""
    rows_a, rows_b = outcome_rows(records, a), outcome_rows(records, b)
    if rows_a is None or rows_b is None or rows_a.shape[1] != rows_b.shape[1]:
        return {}
    return {"paired": paired_bootstrap(rows_a, rows_b)}
