"""The statistics of a study (bench/compare_methods.py): per method the mean +- std over seeds and the
collapses; per contrast Welch's t-test over the seeds, its t distribution written out (scipy is not a
dependency), and the verdict it earns."""
import math
import statistics


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


def distinguishable(w):
    return w["p"] is not None and w["p"] < ALPHA


def difference(summary, a, b, key="final_greedy", scale=100):
    """Mean of a minus mean of b on `key` (x scale: points), with Welch's interval and p (welch); NaN
    diff when a side has no values."""
    (ma, sa, na), (mb, sb, nb) = summary[a][key], summary[b][key]
    if min(na, nb) == 0:
        return {"diff": float("nan"), "se": None, "df": None, "t": None, "ci": None, "p": None}
    return welch(scale * ma, scale * sa, na, scale * mb, scale * sb, nb)


def verdict(a, b, w, what="ends higher than"):
    """The sentence a contrast earns: "a ends higher than b" (or b than a) at p < ALPHA, else "not
    distinguishable"."""
    if not distinguishable(w):
        return "not distinguishable"
    return f"{a} {what} {b}" if w["diff"] > 0 else f"{b} {what} {a}"


def compare(summary, a, b):
    """The paper's ordering a >= b on mean final greedy accuracy, with Welch's interval and p; the verdict
    ranks them only at p < ALPHA."""
    if a not in summary or b not in summary:
        return None
    w = difference(summary, a, b)
    return {"pair": f"{a} >= {b}", "diff_points": w["diff"], "se_points": w["se"], "df": w["df"],
            "ci_points": w["ci"], "p": w["p"], "verdict": verdict(a, b, w)}


def answer(summary, a, b, question):
    """One verdict line of a study: a - b on final greedy (the verdict), pass@k and first-fifth entropy."""
    if a not in summary or b not in summary:
        return None
    out = {"question": question, "a": a, "b": b}
    for key, scale, what in (("final_greedy", 100, "ends higher than"), ("final_pass_k", 100, "ends higher than"),
                             ("entropy_first_fifth", 1, "samples with more entropy than")):
        if key == "final_pass_k" and not summary[a]["k"]:
            continue  # evaluated greedy only (--eval-k 0)
        w = difference(summary, a, b, key, scale)
        out[key] = {**w, "verdict": verdict(a, b, w, what)}
    # where the two bases start apart (bf16 against 4-bit), the same seeds' gain over their own start too: a
    # final-accuracy lead can be the head start alone (read beside the verdict, which stays on final greedy)
    if summary[a]["start_greedy"][0] != summary[b]["start_greedy"][0]:
        w = difference(summary, a, b, "gain_points", 1)
        out["gain_points"] = {**w, "verdict": verdict(a, b, w, "gains more than")}
    return out
