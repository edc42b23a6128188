"""The four figures of the docs, drawn from real numbers of this repository's code:

    nvfp4_block.png   one block of 16 weights through 01_quantize.quantize_nvfp4: codes, bytes, scales
                      (the block `python 01_quantize.py --show-block` prints)
    grpo_step.png     one GRPO step of stage 05: the noisy sampler, the clean trainer, the update
    aqn_columns.png   AQN's noise on RMSNorm gains is noise on the next Linear's input columns (stage 04)
    aqn_schedule.png  AQN's sigma per step of the default run, for each of the trainer's decays (qerl.aqn.DECAYS)
    aqn_entropy.png   the sampler's entropy per step with and without AQN, from the committed 750-step runs
                      (bench/results/steps750/runs.tar.xz: QeRL and NVFP4 + LoRA, 2 seeds each)

    python docs/figures/make_figures.py      # writes the five PNGs beside this file (~10 s)

matplotlib is an optional extra, as for bench/plot_run.py: `.venv/bin/pip install matplotlib==3.10.7`.
"""
import importlib
import json
import os
import sys
import tarfile

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
quantize = importlib.import_module("01_quantize")
aqn = importlib.import_module("qerl.aqn")  # the trainer's: every decay (DECAYS) and noise (NOISES)
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
except ImportError:
    sys.exit("make_figures.py needs matplotlib, an optional extra: .venv/bin/pip install matplotlib==3.10.7")

plt.rcParams.update({"font.size": 11, "savefig.dpi": 150, "savefig.bbox": "tight"})
BLUE, RED, GREY, YELLOW = "#dbe8f6", "#f9e0dc", "#ececec", "#fbefc4"


def cell(ax, x, y, w, h, text, color, size=10, family=None):
    ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="#555555", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, family=family)


def nvfp4_block(path):
    """a. 01's --show-block weight, (4, 64) seed 0, through quantize_nvfp4; row 0's first block of 16, stage by stage."""
    W = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.02  # (out, in): 01 show_block's weight
    packed, scale, gs = quantize.quantize_nvfp4(W)  # (4, 32) uint8, (4, 4) fp8, (1,) fp32
    w = W[0, :16]  # (16,)
    byts = packed[0, :8]  # (8,)
    codes = torch.stack((byts & 0xF, byts >> 4), -1).reshape(16)  # (16,) even element in the low nibble
    s, g = float(scale[0, 0].float()), float(gs)
    decoded = quantize.dequantize_nvfp4(packed, scale, gs)[0, :16]  # (16,)
    assert torch.equal(decoded, quantize.E2M1_VALUES[codes.long()] * (scale[0, 0].float() / gs))  # e2m1(code) * s / g

    fig, ax = plt.subplots(figsize=(13, 5.6))
    ax.set_xlim(-4.6, 19.6), ax.set_ylim(-0.9, 6.4), ax.axis("off")
    lim = float(W.abs().max())
    tint = lambda v: plt.cm.coolwarm(0.5 + 0.45 * v / lim)  # noqa: E731  same colours for weights and decoded
    short = lambda v: f"{v:.3f}".replace("0.", ".")  # noqa: E731  -0.023 -> -.023: fits a cell
    rows = [(5.0, "16 weights\n(one block of a row)"), (3.5, "16 E2M1 codes\n(value, 4 bits: sign+index)"),
            (2.0, "8 packed bytes\n+ 1 FP8 E4M3 scale"), (0.5, "decoded\ne2m1(code) x s / g")]
    for y, label in rows:
        ax.text(-0.3, y + 0.45, label, ha="right", va="center", fontsize=10.5)
    for i in range(16):
        cell(ax, i, 5.0, 1, 0.9, short(float(w[i])), tint(float(w[i])), 9)
        v = float(quantize.E2M1_VALUES[int(codes[i])])
        cell(ax, i, 3.5, 1, 0.9, f"{v:+g}\n{int(codes[i]):04b}", plt.cm.coolwarm(0.5 + 0.075 * v), 9, "monospace")
        cell(ax, i, 0.5, 1, 0.9, short(float(decoded[i])), tint(float(decoded[i])), 9)
    for j in range(8):
        cell(ax, 2 * j, 2.0, 2, 0.9, f"0x{int(byts[j]):02X}", GREY, 10, "monospace")
    sbyte = int(scale[0, 0].view(torch.uint8))
    cell(ax, 16.3, 1.85, 3.2, 1.2, f"s = 0x{sbyte:02X} = {s:g}\nFP8 E4M3, one per block:\nfp8(amax(block) x g / 6)",
         YELLOW, 9)
    cell(ax, 16.3, 4.85, 3.2, 1.2, f"g = {g:.1f}\nFP32, one per tensor:\n448 x 6 / amax(W)", YELLOW, 9)
    steps = [(4.95, "divide by s / g, round to the nearest E2M1 value (ties to even)"),
             (3.45, "pack two codes per byte: element 2j in the low nibble, 2j+1 in the high"),
             (1.95, "decode: E2M1 value x s / g")]
    for y, text in steps:
        ax.annotate("", (8, y - 0.5), (8, y), arrowprops={"arrowstyle": "->", "lw": 1.2})
        ax.text(8.25, y - 0.27, text, va="center", fontsize=9.5, style="italic")
    err = float((decoded - w).abs().max())
    ax.text(8, -0.45, f"storage: 16 x 4 bits + 8 bits = 72 bits = 4.5 bits per weight (+ 32 bits per tensor)."
            f"  Largest error in this block: {err:.4f}", ha="center", fontsize=10)
    ax.set_title("NVFP4 (01_quantize.quantize_nvfp4 on --show-block's weight):  W = e2m1(code) x e4m3(s) / g",
                 fontsize=13)
    fig.savefig(path)
    plt.close(fig)


def box(ax, x, y, text, color, w=2.3, h=1.25):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", facecolor=color,
                                edgecolor="#444444", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=9.5, linespacing=1.35)


def arrow(ax, a, b, text="", style="-", rad=0.0, dx=0.0, dy=0.0, ha="center", color="#222222"):
    ax.annotate("", b, a, arrowprops={"arrowstyle": "-|>", "lw": 1.3, "linestyle": style, "color": color,
                                      "connectionstyle": f"arc3,rad={rad}", "shrinkA": 0, "shrinkB": 0})
    if text:
        ax.text((a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy, text, ha=ha, va="center", fontsize=9, color=color)


def grpo_step(path):
    """b. One step of 05_grpo.train's loop: sample under AQN, score, then update the clean policy."""
    fig, ax = plt.subplots(figsize=(13.5, 5.6))
    ax.set_xlim(-0.2, 14.8), ax.set_ylim(-0.45, 5.0), ax.axis("off")
    ax.add_patch(plt.Rectangle((-0.15, 2.7), 14.9, 2.2, facecolor="#fdf4f2", edgecolor="none"))
    ax.add_patch(plt.Rectangle((-0.15, 0.05), 14.9, 2.2, facecolor="#f2f6fc", edgecolor="none"))
    ax.text(0.0, 4.7, "sampling, no gradients: the NOISY policy", fontsize=10.5, color="#a33", weight="bold")
    ax.text(0.95, 1.3, "update:\nthe CLEAN\npolicy,\ngradients on\nLoRA only", fontsize=10.5, color="#248",
            weight="bold", ha="center", va="center")
    top, bot, h = 3.7, 1.3, 0.82  # row centres, half a box's height
    pi = r"$\pi_\theta\,/\,\pi_{old}$"
    # (centre x, width, text, colour) of each box; arrows join neighbours' edges
    tops = [(0.95, 1.9, "B prompts\n(task.problems)", GREY),
            (4.05, 3.1, "sampler: NVFP4 base + LoRA\nAQN: Z ~ N(0, σ²) added to\nthe RMSNorm gains,\n"
             "σ = sigma_schedule(step)", RED),
            (7.5, 2.6, "G completions\nper prompt\n+ sampler log-probs", RED),
            (10.35, 1.9, "rewards r\n(task.reward)", GREY),
            (13.25, 2.7, "group advantages\nA = (r - mean_G r)\n/ (std_G r + 1e-4)", GREY)]
    bots = [(4.05, 3.1, "trainer: the same NVFP4\nbase + LoRA, no noise\n" + r"$\rightarrow \log \pi_\theta$"
             " (with gradients)", BLUE),
            (7.6, 2.8, f"ratio {pi}\n" + r"$\pi_{old}$" + ": the trainer's,\ndetached (default, the\n"
             "official code), or the\nsampler's (--pi-old sampler)", BLUE),
            (10.75, 2.3, "clipped loss\n-min(ratio A,\nclip(ratio, 0.8, 1.28) A)", BLUE),
            (13.55, 2.1, "AdamW on\nLoRA only\n(NVFP4 base\nfrozen)", BLUE)]
    for y, row in ((top, tops), (bot, bots)):
        for x, w, text, color in row:
            box(ax, x, y, text, color, w=w, h=2 * h)
        for (x0, w0, *_), (x1, w1, *_) in zip(row, row[1:]):
            arrow(ax, (x0 + w0 / 2 + 0.08, y), (x1 - w1 / 2 - 0.08, y))
    arrow(ax, (6.9, top - h - 0.08), (4.9, bot + h + 0.08), "completion\ntokens", dx=-0.75)
    arrow(ax, (8.4, top - h - 0.08), (8.4, bot + h + 0.08), "sampler log-probs\n(--pi-old sampler)",
          style="--", dx=0.12, ha="left", color="#a33")
    arrow(ax, (13.25, top - h - 0.08), (11.3, bot + h + 0.08), "A per row", dx=0.45)
    arrow(ax, (13.55, bot - h - 0.08), (4.05, bot - h - 0.08), rad=-0.08)
    ax.text(8.8, -0.2, "next step: the updated LoRA (sampler and trainer are one model, with and without noise)",
            ha="center", fontsize=9.5)
    ax.set_title("One GRPO step in QeRL (05_grpo.train's loop): noise only where it samples, the update on the "
                 "clean policy", fontsize=12.5)
    fig.savefig(path)
    plt.close(fig)


def aqn_columns(path, layer=0, sigma=1e-2, rows=32):
    """c. assets/tiny-qwen's layer-0 input_layernorm gains w, one AQN draw Z at sigma, and q_proj's columns."""
    sd = load_file(os.path.join(ROOT, "assets", "tiny-qwen", "model.safetensors"))
    w = sd[f"model.layers.{layer}.input_layernorm.weight"]  # (C,)
    W = sd[f"model.layers.{layer}.self_attn.q_proj.weight"]  # (out, C): reads the norm's output
    z = aqn.NOISES["absolute"](w, sigma, torch.Generator().manual_seed(0))  # (C,) exactly as stage 04 draws it
    factor = 1 + z / w  # (C,) multiplies input column i of W
    x_hat = torch.randn(5, w.numel(), generator=torch.Generator().manual_seed(1))  # (N, C) some rmsnorm(x)
    lhs, rhs = ((w + z) * x_hat) @ W.T, ((factor * (w * x_hat)) @ W.T)  # (N, out) each
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-6)  # the identity the figure draws
    C, i = w.numel(), torch.arange(w.numel())
    fig, axs = plt.subplots(5, 2, figsize=(12, 9.5), width_ratios=[60, 1],
                            gridspec_kw={"height_ratios": [1, 1, 1, 2, 2], "hspace": 0.45, "wspace": 0.02})
    bars = [(w, f"gains w_i (layer {layer} input_layernorm)", "#4a7ab5", 0),
            (z, f"AQN draw Z_i ~ N(0, σ²), σ = {sigma:g} (04_aqn.NOISES['absolute'], seed 0)", "#c0504d", 0),
            (factor, f"column factor 1 + Z_i / w_i: relative noise of std σ / |w_i| (here about "
                     f"{100 * sigma / float(w.abs().mean()):.1f}%)", "#7a5ab5", 1)]
    for ax, (v, title, color, base) in zip(axs[:3, 0], bars):
        ax.bar(i, (v - base).numpy(), bottom=base, width=0.8, color=color)
        ax.set_title(title, fontsize=11, loc="left")
        ax.set_xlim(-0.5, C - 0.5)
    axs[0, 0].set_ylim(0, float(w.max()) * 1.1)
    lim = float(W[:rows].abs().max())
    im = axs[3, 0].imshow(W[:rows].numpy(), aspect="auto", cmap="coolwarm", vmin=-lim, vmax=lim,
                          extent=(-0.5, C - 0.5, rows - 0.5, -0.5), interpolation="nearest")
    axs[3, 0].set_title(f"W: q_proj rows 0-{rows - 1} (of {W.shape[0]}), one column per input i", fontsize=11, loc="left")
    fig.colorbar(im, cax=axs[3, 1])
    dW = (W[:rows] * factor - W[:rows]).numpy()  # (rows, C) = W * (Z / w): column i scaled by Z_i / w_i
    dlim = float(abs(dW).max())
    im = axs[4, 0].imshow(dW, aspect="auto", cmap="PuOr", vmin=-dlim, vmax=dlim,
                          extent=(-0.5, C - 0.5, rows - 0.5, -0.5), interpolation="nearest")
    axs[4, 0].set_title("what the noise does to W: W (1 + Z/w) - W, column i scaled by Z_i / w_i",
                        fontsize=11, loc="left")
    axs[4, 0].set_xlabel("input column i of W = channel i of the norm")
    fig.colorbar(im, cax=axs[4, 1])
    for ax in axs[:3, 1]:
        ax.axis("off")
    fig.suptitle(r"$((w + Z) \odot \hat{x})\,W^{T} = ((1 + Z/w) \odot (w \odot \hat{x}))\,W^{T}$"
                 "   AQN's noise on gain i is noise on input column i of the next Linear", fontsize=13, y=0.95)
    fig.savefig(path)
    plt.close(fig)


def aqn_schedule(path, steps=750, s0=1e-2, s1=5e-4, K=10):
    """d. 04_aqn.sigma_schedule at every step of the default run (05's --steps, --sigma-*, --num-stages), per kind."""
    x = list(range(steps)) + [steps]  # the last point closes the last step's stair
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.6))
    colors = {"exp": "#c0504d", "linear": "#4a7ab5", "cosine": "#7a5ab5", "log": "#5a9a5a"}
    for ax, scale in zip(axs, ("linear", "log")):
        for kind in aqn.DECAYS:
            sig = [aqn.sigma_schedule(min(s, steps - 1), steps, s0, s1, K, kind) for s in x]
            label = "exp (the default: the official code's)" if kind == "exp" else f"{kind} (our form)"
            ax.plot(x, [v if v > 0 else float("nan") for v in sig], drawstyle="steps-post", color=colors[kind],
                    lw=2.4 if kind == "exp" else 1.4, label=label)
        # the paper's Eq. 8 divides by K - 1: its last stage stops one step short of s1
        eq8 = [s0 * (s1 / s0) ** ((k - 1) / (K - 1)) if k else float("nan") for k in
               (aqn.sigma_stage(min(s, steps - 1), steps, K) for s in x)]
        ax.plot(x, eq8, drawstyle="steps-post", color="#777777", ls="--", lw=1.1, label="the paper's Eq. 8")
        for k in range(1, K):
            ax.axvline(-(-k * steps // K), color="#dddddd", lw=0.8, zorder=0)
        ax.set_yscale(scale)
        ax.set_xlim(0, steps)
        ax.set_xlabel("step")
        ax.set_title(f"{scale} axis", fontsize=11, loc="left")
    axs[0].set_ylabel("σ (std of the draw Z on each gain)")
    axs[0].set_ylim(0, s0 * 1.08)
    axs[0].text(steps / K / 2, s0 * 0.5, "stage 0:\nσ = 0,\nrounding\nnoise only", ha="center", va="center",
                fontsize=9)
    axs[1].legend(fontsize=9, loc="lower left")
    fig.suptitle(f"AQN's σ per step, the default run: {steps} steps, {K} stages, {s0:g} -> {s1:g} "
                 "(04_aqn.sigma_schedule, one draw per step)", fontsize=12.5)
    fig.savefig(path)
    plt.close(fig)


def aqn_entropy(path, pack=os.path.join(ROOT, "bench", "results", "steps750", "runs.tar.xz"), window=25):
    """e. The sampler's mean token entropy per step, with AQN (qerl) and without (nvfp4-lora), every seed of the
    committed 750-step study, smoothed over `window` steps; AQN's sigma per step on a second axis."""
    runs = {}
    with tarfile.open(pack) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if parts[-1] == "metrics.jsonl" and parts[-2].rsplit("-", 1)[0] in ("qerl", "nvfp4-lora"):
                lines = tar.extractfile(member).read().decode().splitlines()
                runs[parts[-2]] = [r for r in map(json.loads, lines) if "step" in r and "entropy" in r]
    fig, ax = plt.subplots(figsize=(11, 4.6))
    colors = {"qerl": "#c0504d", "nvfp4-lora": "#4a7ab5"}
    labels = {"qerl": "QeRL: NVFP4 + LoRA + AQN", "nvfp4-lora": "NVFP4 + LoRA (no AQN)"}
    for name in sorted(runs):
        method, seed = name.rsplit("-", 1)
        steps = [r["step"] for r in runs[name]]
        ent = torch.tensor([r["entropy"] for r in runs[name]])  # (steps,)
        smooth = torch.nn.functional.avg_pool1d(ent.view(1, 1, -1), window, 1, window // 2, count_include_pad=False)
        ax.plot(steps, ent.tolist(), color=colors[method], alpha=0.12, lw=0.6)
        ax.plot(steps, smooth.view(-1)[: len(steps)].tolist(), color=colors[method], lw=1.8,
                ls="-" if seed == "s0" else "--", label=f"{labels[method]}, {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("sampler's mean token entropy (nats)")
    ax.set_xlim(0, 750)
    sig = ax.twinx()
    x = list(range(751))
    sig.plot(x, [aqn.sigma_schedule(min(s, 749), 750) for s in x], drawstyle="steps-post", color="#777777",
             lw=1.0, ls=":", label="AQN's σ (right axis)")
    sig.set_ylabel("σ", color="#777777")
    lines = ax.get_legend_handles_labels()
    more = sig.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=9, loc="upper right")
    ax.set_title(f"Entropy per step with and without AQN (bundled model, 750 steps; thin: per step, thick: "
                 f"{window}-step mean; 2 seeds a side,\ndescriptive only: bench/results/steps750 finds the "
                 "arms' final accuracy not distinguishable)", fontsize=11)
    fig.savefig(path)
    plt.close(fig)


def main():
    for name, draw in (("nvfp4_block", nvfp4_block), ("grpo_step", grpo_step), ("aqn_columns", aqn_columns),
                       ("aqn_schedule", aqn_schedule), ("aqn_entropy", aqn_entropy)):
        out = os.path.join(HERE, f"{name}.png")
        draw(out)
        print(f"wrote {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
