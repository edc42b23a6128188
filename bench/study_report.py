"""The report of a study (bench/compare_methods.py): results.json, table.md and curves.png from the runs'
records, the best noise level a second phase uses, and the commands' wall time."""
import json
import math
import os
import statistics
import time

from studies import CONTROL_PAIRS, METHODS, PAPER_PAIRS, STUDIES, best_noise_level, resolve
from study_files import (REPORT, check_fields, collect, flag_values, is_done, is_number, json_kind, load_json,
                         optional, owned_outputs, read_invocations, read_metrics, read_regular, stored_runs,
                         write_text)
from study_stats import ALPHA, BOOTSTRAP_REPLICATES, COLLAPSE_LEN, POWER, answers, checks, summarize

# ---------------------------------------------------------------------------------------------------
# The tables: per method, then the contrasts (the paper's ordering, or a study's questions)


def contrast_text(w, spec=".1f", verdict=False):
    """A difference as "+1.2 [-3.4, +5.6], Welch's t p 0.41, permutation p 0.40" ("no interval" where
    Welch's test has no variance); with verdict (final greedy), the Holm-adjusted p and the MDE too. Every
    p names its test."""
    d = format(w["diff"], "+" + spec)
    if w["p"] is None:
        parts = [f"{d} (no interval: fewer than 2 seeds, or no spread)"]
    else:
        lo, hi = w["ci"]
        parts = [f"{d} [{format(lo, '+' + spec)}, {format(hi, '+' + spec)}]", p_text(w["p"], "Welch's t")]
    if w.get("p_permutation") is not None:
        parts.append(p_text(w["p_permutation"], "permutation" + (" (sampled)" if w.get("permutation_sampled") else "")))
    if verdict and w.get("p_holm") is not None:
        parts.append(p_text(w["p_holm"], "Holm-adjusted"))
    if verdict and w.get("mde") is not None:
        parts.append(f"MDE {format(w['mde'], spec)}")
    return ", ".join(parts)


def p_text(p, test):
    """A p named by its test; three decimals near the 0.05 line (0.049 and 0.051 must not both read 0.05),
    two above 0.1."""
    return f"{test} p < 0.001" if p < 0.001 else f"{test} p {p:.3f}" if p < 0.1 else f"{test} p {p:.2f}"


def paired_text(q):
    """The paired bootstrap over problems and seeds of a question or pair, where its runs kept outcomes."""
    b = q.get("paired")
    if not b:
        return ""
    lo, hi = b["ci"]
    return (f" | paired over {b['problems']} problems x seeds {b['diff']:+.1f} [{lo:+.1f}, {hi:+.1f}], "
            + p_text(b["p"], "bootstrap"))


def family_text(family, what, paired):
    """How a verdict is reached, for the text above a table's contrasts (what: "question" or "pair"; paired:
    whether some contrast has the paired bootstrap)."""
    what += "s" if family != 1 else ""
    text = (f"a - b, the difference of means [its 95% interval, Welch's], p from Welch's t-test over the seeds and "
            f"from an exact permutation test (every relabeling of the per-seed values, two-sided; with 3 seeds a "
            f"side it cannot go below 0.10). On final greedy accuracy also the Holm-adjusted p (Holm's step-down "
            f"over the permutation p of this table's {family} {what}) and the MDE, the difference {POWER:.0%} power "
            f"would detect at alpha {ALPHA:g} two-sided from the observed spread ((t_0.975,df + t_0.8,df) x Welch's "
            f"se). A pair is ranked only at Holm-adjusted p < {ALPHA:g}; otherwise it is not distinguishable, with "
            f"what the seeds could have detected.")
    if paired:
        text += (f" Where every run of both kept which held-out problems it got right: paired over problems x seeds, "
                 f"a two-level bootstrap ({BOOTSTRAP_REPLICATES} replicates, a fixed seed: the problems drawn once "
                 f"for both methods, the seeds within each), the difference of mean accuracy, its 95% percentile "
                 f"interval and the bootstrap p (two-sided, unadjusted).")
    return text


def pct(ms, digits=1):
    m, s, n = ms
    if n == 0:
        return "-"
    return f"{100 * m:.{digits}f} ± {100 * s:.{digits}f}" if n > 1 else f"{100 * m:.{digits}f}"


def fmt(x, spec=".3f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def versions(records, key):
    seen = sorted({str(r[key])[:12] for r in records})
    return " / ".join(seen) + (" (MIXED)" if len(seen) > 1 else "")


def render_table(summary, records, args, checks):
    k = next(iter(summary.values()))["k"] if summary else 0
    steps = records[0]["steps"] if records else 0
    n_eval = records[0]["eval_n"] if records else 0
    lines = [f"# Method comparison: {steps} GRPO steps per run, bundled tiny model, synthetic arithmetic", "",
             table_intro(records, args, k, n_eval), "",
             f"| method | seeds | start greedy | final greedy | collapses | gain (points) | final pass@{k} | "
             f"steps to +{args.threshold:g} (reached) | entropy first → last fifth | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        stm, sts, _ = s["steps_to_threshold"]
        stt = f"{stm:.0f} ({s['reached']}/{s['runs']})" if s["reached"] else f"- (0/{s['runs']})"
        g, gs, gn = s["gain_points"]
        gain = f"{g:+.1f} ± {gs:.1f}" if gn > 1 else f"{g:+.1f}"
        lines.append(f"| {s['label']} | {s['runs']} | {pct(s['start_greedy'])} | {pct(s['final_greedy'])} | "
                     f"{s['collapses']} of {s['runs']} | {gain} | "
                     f"{pct(s['final_pass_k'])} | {stt} | {s['entropy_first_fifth'][0]:.3f} → "
                     f"{s['entropy_last_fifth'][0]:.3f} | {s['s_per_step'][0]:.2f} |")
    family = checks[0]["final_greedy"]["family"] if checks else 0
    lines += ["", "Paper (Table 1, GSM8K, Qwen2.5-3B/7B): qerl >= nvfp4-lora >= lora >= qlora. Here, on final "
              "greedy accuracy in points: " + family_text(family, "pair", any("paired" in c for c in checks)), ""]
    if not checks:
        lines.append("- (no pair of compared methods was run)")
    for c in checks:
        g = c["final_greedy"]
        lines.append(f"- {c['pair']}: {contrast_text(g, verdict=True)} -> {g['verdict']}" + paired_text(c))
    lines += collapse_lines(summary, records)
    return "\n".join(lines + per_run_lines(summary, records)) + "\n"


def table_intro(records, args, k, n_eval):
    temps = sorted({r.get("temperature") or 1.0 for r in records}) or [1.0]
    return (f"Mean ± std over seeds (sample std). Accuracies in % on {n_eval} held-out problems (greedy"
            + (f"; pass@{k} at temperature {'/'.join(f'{t:g}' for t in temps)}" if k else "") + "). Steps"
            f" to +{args.threshold:g}: first evaluation (every "
            f"{records[0].get('eval_every', args.eval_every) if records else args.eval_every} steps) at least "
            f"{args.threshold:g} points above the start, mean over the seeds that got there. Entropy: mean "
            f"per-token sampling entropy (nats) over the first and last fifth of the steps. Versions (md5): "
            f"stage files {versions(records, 'code_md5')}, model weights {versions(records, 'model_md5')}.")


def per_run_lines(summary, records):
    lines = ["", "Per run (seed: final greedy %, steps to threshold):", ""]
    for m in summary:
        rs = sorted((r for r in records if r["method"] == m), key=lambda r: r["seed"])
        cells = ", ".join(f"s{r['seed']}: {100 * r['final_greedy']:.1f} / {r['steps_to_threshold'] or '-'}"
                          + (" (collapsed)" if r.get("collapse") else "") for r in rs)
        lines.append(f"- {m}: {cells}")
    return lines


def collapse_lines(summary, records):
    """The collapsed runs, each with why (collapse()), after the contrasts."""
    bad = [r for m in summary for r in sorted(records, key=lambda r: r["seed"]) if r["method"] == m and r.get("collapse")]
    head = (f"Collapses (a run that ends below its start, or whose completions shrink under {COLLAPSE_LEN:.0%} of "
            f"their first fifth's mean length), counted apart from the means above: ")
    if not bad:
        return ["", head + "none."]
    return ["", head + f"{len(bad)} of {len(records)} runs.", ""] + [f"- {r['method']} seed {r['seed']}: {r['collapse']}"
                                                                     for r in bad]


def ms(x, spec):
    """A (mean, std, n) triple as "mean ± std" ("-" without values)."""
    m, s, n = x
    return "-" if n == 0 else f"{format(m, spec)} ± {format(s, spec)}" if n > 1 else format(m, spec)


def render_study_table(summary, records, args, answers, best):
    study, k = STUDIES[args.study], next(iter(summary.values()))["k"]
    th = f"{args.threshold:g}"
    # (header, cell) per column: pass@k where it was evaluated, the mismatch where 05 logged it
    mismatch = any(s["mismatch_kl"][2] for s in summary.values())
    columns = [("method", lambda s: s["label"]), ("seeds", lambda s: str(s["runs"])),
               ("start greedy", lambda s: pct(s["start_greedy"])),
               *([(f"start pass@{k}", lambda s: pct(s["start_pass_k"]))] if k else []),
               ("entropy, first fifth", lambda s: ms(s["entropy_first_fifth"], ".4f")),
               (f"steps to +{th} (reached)", lambda s: f"{ms(s['steps_to_threshold'], '.0f')} ({s['reached']}/{s['runs']})"),
               ("final greedy", lambda s: pct(s["final_greedy"])),
               ("collapses", lambda s: f"{s['collapses']} of {s['runs']}"),
               *([(f"final pass@{k}", lambda s: pct(s["final_pass_k"]))] if k else []),
               ("entropy, last fifth", lambda s: ms(s["entropy_last_fifth"], ".4f")),
               ("kl_old", lambda s: ms(s["kl_old"], ".2e")),
               *([("mismatch KL", lambda s: ms(s["mismatch_kl"], ".2e")),
                  ("beyond cap 2 %", lambda s: pct(s["is_beyond_cap"], 2)),
                  ("grad norm", lambda s: ms(s["grad_norm"], ".2f"))] if mismatch else []),
               ("clip %", lambda s: pct(s["clip"], 2)), ("s/step", lambda s: f"{s['s_per_step'][0]:.2f}")]
    budgeted = records[0].get("max_completions")
    if budgeted:  # the steps differ by design: what each method took for its completions
        columns[2:2] = [("steps taken", lambda s: ms(s["steps_taken"], ".1f")),
                        ("completions", lambda s: ms(s["completions"], ",.0f"))]
    budget = (f"A budget of {budgeted:,} sampled completions per run (--max-completions: refills counted, the LR "
              f"and AQN schedules spread over it; a run stops at the step that spends it)." if budgeted else
              f"{records[0]['steps']} GRPO steps per run.")
    lines = [f"# Study '{args.study}': {study['title']}", "",
             f"{budget} " + table_intro(records, args, k, records[0]["eval_n"])
             + (" Mismatch KL: the k3 estimate of KL(sampler || trainer) on the sampled tokens; beyond cap: the "
                "tokens whose trainer/sampler ratio exceeds 2; grad norm: before clipping; each a mean over the steps."
                if mismatch else ""), "",
             "| " + " | ".join(h for h, _ in columns) + " |", "|---" * len(columns) + "|"]
    for m, s in summary.items():
        lines.append("| " + " | ".join(cell(s) for _, cell in columns) + " |")
    if study["after_best"]:
        lines += ["", "Best nonzero NVFP4 noise level (mean final greedy of the noise sweep): "
                  + (f"{best:g} -> {best / 20:g}." if best is not None else "not known yet (the sweep is unfinished).")]
    family = answers[0]["final_greedy"]["family"] if answers else 0
    lines += ["", "Questions (points; entropy in nats): "
              + family_text(family, "question", any("paired" in q for q in answers))
              + (" Where the two start apart, the gain over start (final - start greedy, per run) is given too."
                 if any("gain_points" in q for q in answers) else ""), ""]
    for q in answers:
        g, p, e = q["final_greedy"], q.get("final_pass_k"), q["entropy_first_fifth"]
        lines.append(f"- {q['question']} ({q['a']} - {q['b']}): final greedy {contrast_text(g, verdict=True)} -> "
                     f"**{g['verdict']}**{paired_text(q)} "
                     + (f"| gain over start {contrast_text(q['gain_points'])} " if "gain_points" in q else "")
                     + (f"| final pass@{k} {contrast_text(p)} " if p else "")
                     + f"| first-fifth entropy {contrast_text(e, '.4f')}")
    if not answers:
        lines.append("- (no question has both of its methods run yet)")
    return "\n".join(lines + collapse_lines(summary, records) + per_run_lines(summary, records)) + "\n"

# ---------------------------------------------------------------------------------------------------
# The plot (optional): reward, held-out greedy accuracy and entropy vs step, min-max band over seeds


def smooth(values, window):
    """Trailing moving average (the first points average what exists so far); a None (a step that logged
    nothing for this key, such as the mismatch of a step whose groups all tied) is left out of its windows."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(statistics.mean(seen) if seen else math.nan)
    return out


def band(curves):
    """curves: lists of equal length -> (mean, min, max) per position, over the curves that have a value there."""
    cols = [[v for v in c if not math.isnan(v)] or [math.nan] for c in zip(*curves)]
    return ([statistics.mean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])


# what a panel of curves.png shows: a step record's key (smoothed) or "eval" (held-out greedy accuracy)
PANELS = {"reward": "training reward", "eval": "held-out greedy accuracy (%)",
          "entropy": "sampling entropy, nats/token", "mismatch_kl": "sampler vs trainer token KL (k3)",
          "grad_norm": "gradient norm (before clipping)", "len": "completion length, tokens"}
DEFAULT_PANELS = ("reward", "eval", "entropy")


def render_plot(records, summary, runs, path, table=METHODS, panels=DEFAULT_PANELS):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot | matplotlib is not installed: skipped curves.png (pip install matplotlib to get it)")
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(16, 4.6 * rows), squeeze=False)
    axes = dict(zip(panels, axes.flat))
    steps_total = records[0]["steps"]
    window = max(1, steps_total // 20)
    for m in summary:
        rs = [r for r in records if r["method"] == m]
        colour, label = table[m][2], f"{table[m][0]} (n={len(rs)})"
        per_run = [read_metrics(runs[f"{m}-s{r['seed']}"]["metrics.jsonl"])[0] for r in rs]
        n = min(len(p) for p in per_run)
        x = [rec["step"] for rec in per_run[0][:n]]
        for key in panels:
            if key == "eval":
                continue
            if not all(key in rec for p in per_run for rec in p[:n]):
                continue  # a run from before the key was logged (mismatch_kl): no curve for this method
            ax = axes[key]
            mean, lo, hi = band([smooth([rec[key] for rec in p[:n]], window) for p in per_run])
            ax.plot(x, mean, color=colour, label=label, lw=1.6)
            ax.fill_between(x, lo, hi, color=colour, alpha=0.15, lw=0)
        curves = [r["eval_curve"] for r in rs]
        ne = min(len(c) for c in curves)
        ex = [c[0] for c in curves[0][:ne]]
        mean, lo, hi = band([[100 * g for _, g in c[:ne]] for c in curves])
        axes["eval"].plot(ex, mean, color=colour, label=label, lw=1.6, marker="o", ms=3)
        axes["eval"].fill_between(ex, lo, hi, color=colour, alpha=0.15, lw=0)
    for key, ax in axes.items():
        ax.set_title(PANELS[key] + ("" if key == "eval" else f" (moving average of {window} steps)"), fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    if "mismatch_kl" in axes:
        axes["mismatch_kl"].set_yscale("symlog", linthresh=1e-5)
    axes["eval"].legend(fontsize=8, loc="lower right")
    fig.suptitle("Line: mean over seeds; band: min-max over seeds", fontsize=9)
    fig.tight_layout()
    tmp = path + f".tmp{os.getpid()}"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------
# Writing results.json, table.md, curves.png


def json_lines(obj, expand=2, indent=""):
    """JSON with the first `expand` levels one item per line and everything deeper on its item's line:
    one line per run, per method and per question, so that results.json stays short and diffs by run."""
    if expand == 0 or not isinstance(obj, (dict, list)) or not obj:
        return json.dumps(obj)
    inner = indent + " "
    items = ([f"{inner}{json.dumps(k)}: {json_lines(v, expand - 1, inner)}" for k, v in obj.items()]
             if isinstance(obj, dict) else [inner + json_lines(v, expand - 1, inner) for v in obj])
    brackets = "{}" if isinstance(obj, dict) else "[]"
    return brackets[0] + "\n" + ",\n".join(items) + "\n" + indent + brackets[1]


def clean(obj):
    """NaN -> None so results.json is strict JSON; (mean, std, n) tuples -> dicts."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, tuple) and len(obj) == 3:
        return {"mean": clean(obj[0]), "std": clean(obj[1]), "n": obj[2]}
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj


def report(args, records):
    if not records:
        raise ValueError(f"no finished runs to report in {os.path.join(args.out, 'runs')}")
    order = [m for m in args.table if any(r["method"] == m for r in records)]
    summary = summarize(records, order)
    pairs = checks(summary, records, PAPER_PAIRS + CONTROL_PAIRS) if not args.study else []
    _, runs = stored_runs(args.out)
    first = runs[f"{records[0]['method']}-s{records[0]['seed']}"]
    train_args = load_json(first["args.json"]) if "args.json" in first else {}
    varied = {k for m in order for k in flag_values(args.table[m][1])}  # what the methods set differs per run
    for key in {"out", "seed", "quant", "aqn", "model"} | varied:
        train_args.pop(key, None)
    results = {"threshold_points": args.threshold, "steps": records[0]["steps"],
               "shared_05_args": train_args, "methods": summary, "ordering_checks": pairs,
               "runs": records}
    if args.study:
        best = study_best(args, summary)
        answered = answers(summary, records, resolve(args, "questions", best))
        results = {"study": args.study, "best_noise_level": best, "questions": answered,
                   "invocations": read_invocations(args.out), **results}
        table = render_study_table(summary, records, args, answered, best) + invocation_lines(args.out)
    else:
        table = render_table(summary, records, args, pairs)
    with owned_outputs(args.out, REPORT):
        write_text(os.path.join(args.out, "results.json"), json_lines(clean(results)) + "\n")
        write_text(os.path.join(args.out, "table.md"), table)
        print(table)
        plot = render_plot(records, summary, runs, os.path.join(args.out, "curves.png"), args.table,
                           (STUDIES[args.study].get("curves", DEFAULT_PANELS) if args.study else DEFAULT_PANELS))
    print(f"wrote | {os.path.join(args.out, 'results.json')} | {os.path.join(args.out, 'table.md')}"
          + (f" | {plot}" if plot else ""))


# ---------------------------------------------------------------------------------------------------
# The best noise level a second phase uses, and the commands' wall time


def study_best(args, summary=None):
    """The noise level the second phase uses: --noise-level, else the noise study's sweep once every
    level has every requested seed (from this study's runs, or for the hard study from the results.json
    of the noise study next to --out); None while unknown."""
    study = STUDIES[args.study]
    if args.noise_level is not None or not study["after_best"]:
        return args.noise_level
    if study["best_from"] == "noise":
        return noise_results_best(os.path.join(os.path.dirname(args.out), "noise", "results.json"))
    _, runs = stored_runs(args.out)
    if not all(is_done(runs.get(f"{m}-s{s}"), args.steps) for m in study["first"] for s in args.seeds):
        return None
    if summary is None:
        summary = summarize(collect(args, [(m, s) for s in args.seeds for m in study["first"]]), study["first"])
    return best_noise_level(summary)


def noise_results_best(path):
    """The noise study's best level from its results.json (None while there is none): a number > 0, or
    null; anything else is one line naming the file and the field."""
    try:
        obj = load_json(read_regular(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): rerun the noise study's --from-results, or pass "
                         f"--noise-level") from None
    problems = []
    if not isinstance(obj, dict):
        problems.append(f"{path} holds {json_kind(obj)}, not a JSON object")
    else:
        check_fields(obj, path, {"best_noise_level": (optional(lambda v: is_number(v) and v > 0), "a noise level "
                                                      "(a number > 0) or null", False)}, problems)
    if problems:
        raise ValueError(problems[0] + ": rerun the noise study's --from-results, or pass --noise-level")
    return obj.get("best_noise_level")


def wall_union(inv):
    """Seconds covered by the invocations' [start, start + wall] intervals: a second copy started beside
    the first (to fill a free core) adds only the time it ran alone."""
    spans = sorted((t, t + i["wall_s"]) for i in inv
                   for t in [time.mktime(time.strptime(i["started"], "%Y-%m-%d %H:%M:%S"))])
    total, end = 0.0, -math.inf
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def invocation_lines(out):
    inv = read_invocations(out)
    if not inv:
        return ""
    return "\n".join(["", f"Commands ({wall_union(inv) / 60:.0f} min of wall time in all; copies that ran at the same "
                          f"time count once):", ""] +
                     [f"- `{i['command']}` ({i['started']}, {i['wall_s'] / 60:.0f} min)" for i in inv]) + "\n"
