"""What AQN's sigma means on a model: its RMSNorm gains per layer, and the relative perturbation 1 + Z / w that
an absolute draw Z ~ N(0, sigma^2) puts on each next Linear's input columns (04 NOISES "absolute"), against the
relative kind (Z_i ~ N(0, (sigma w_i)^2): sigma itself, on every model).

    python bench/aqn_gains.py                                           # the bundled tiny model
    python bench/aqn_gains.py --model ~/.cache/qerl/smollm2-135m-instruct --sigma 1e-2

Reads only the norm gains from the safetensors files (seconds, no model built).
"""
import importlib
import os
import statistics
import sys

from safetensors import safe_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
hf_files = importlib.import_module("qerl.hf_files")
aqn = importlib.import_module("qerl.aqn")


def gains(model_dir):
    """{(layer, norm name): |gains| (C,) fp32} for the norms AQN perturbs."""
    _, weight_map, _ = hf_files.find_weight_files(model_dir)
    out = {}
    for name, file in sorted(weight_map.items()):
        parts = name.split(".")
        if len(parts) == 5 and parts[1] == "layers" and parts[3] in aqn.AQN_NORMS and parts[4] == "weight":
            with safe_open(os.path.join(model_dir, file), "pt") as f:
                out[(int(parts[2]), parts[3])] = f.get_tensor(name).float().abs()
    return out


def main(argv=None):
    p = cli.ArgumentParser(description="AQN's sigma relative to a model's RMSNorm gains, per layer")
    p.add_argument("--model", default=os.path.join(ROOT, "assets", "tiny-qwen"))
    p.add_argument("--sigma", type=cli.number(above=0), default=1e-2, help="the absolute sigma (the paper's peak)")
    args = p.parse_args(argv)
    g = gains(args.model)
    if not g:
        raise ValueError(f"{args.model}: no {' or '.join(aqn.AQN_NORMS)} gains found")
    print(f"model {args.model} | sigma {args.sigma:g} | per layer: median |w|, share of |w| < 0.05, and sigma / "
          f"median |w| (the typical relative column noise of the absolute kind; the relative kind: {args.sigma:g})")
    print("layer | norm | median |w| | |w| < 0.05 | sigma / median |w|")
    for (layer, norm), w in sorted(g.items()):
        med = float(w.median())
        print(f"{layer:5d} | {norm:24s} | {med:10.4f} | {float((w < 0.05).float().mean()):10.1%} | "
              f"{args.sigma / max(med, 1e-12):.2%}")
    for norm in aqn.AQN_NORMS:
        meds = [float(w.median()) for (_, n), w in g.items() if n == norm]
        print(f"all   | {norm:24s} | {statistics.median(meds):10.4f} |            | "
              f"{args.sigma / statistics.median(meds):.2%}")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
