#!/usr/bin/python3
"""Summary table and loss-curve plot of scripts/compare-ddp.sh: gradapt's composed step
(examples/torch_transformer.cpp) against PyTorch DDP (bench/ddp_transformer.py).

Reads <dir>/{gradapt,ddp}_np<N>_seed<S>.{csv,log}; writes a Markdown summary (step time,
optimizer-state bytes per rank, final losses, run-to-run spread, ratios) and a PNG with one
panel per world size, every run's loss curve (10-step moving average), both sides.

    /usr/bin/python3 bench/plot_ddp_transformer.py --dir build/compare-ddp \
        --png docs/img/ddp_transformer_loss.png --summary build/compare-ddp/summary.md

Loss curves: "spread" is the largest gap, over the steps, between two runs of one side with
different data seeds (the smaller of the two sides' values); "gap, same seed" the largest gap
between gradapt's and DDP's runs with the same seed; "gap, seed means" the largest gap between
the two sides' curves averaged over the seeds. All on the 10-step moving averages.
"""
import argparse
import csv
import glob
import itertools
import os
import re

SMOOTH = 10


def read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows]


def read_log(path):
    text = open(path).read()

    def grab(pattern):
        m = re.search(pattern, text)
        if not m:
            raise SystemExit(f"plot_ddp_transformer: '{pattern}' not found in {path}")
        return m.group(1)

    return {
        "step_ms": float(grab(r"mean step time: ([0-9.]+) ms")),
        "state_bytes": int(grab(r"optimizer state bytes per rank: ([0-9]+)")),
        "final_loss": float(grab(r"final loss: ([0-9.]+)")),
        "identical": grab(r"replicas bitwise identical: (\w+)"),
        "recipe": grab(r"\n(\w+_transformer: [^\n]*steps)\n"),
        "breakdown": grab(r"\nbreakdown: ([^\n]*) \(each the slowest rank's mean\)"),
    }


def smooth(xs):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= SMOOTH:
            acc -= xs[i - SMOOTH]
        out.append(acc / min(i + 1, SMOOTH))
    return out


def max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="build/compare-ddp")
    ap.add_argument("--png", default="docs/img/ddp_transformer_loss.png")
    ap.add_argument("--summary", default="")
    o = ap.parse_args()

    runs = {}  # (side, ranks) -> {seed: (log, smoothed loss)}
    for path in sorted(glob.glob(os.path.join(o.dir, "*_np*_seed*.log"))):
        m = re.match(r"(gradapt|ddp)_np(\d+)_seed(\d+)\.log$", os.path.basename(path))
        if not m:
            continue
        side, n, seed = m.group(1), int(m.group(2)), int(m.group(3))
        loss = read_csv(path[:-4] + ".csv")
        runs.setdefault((side, n), {})[seed] = (read_log(path), loss)
    sizes = sorted({n for _, n in runs})
    if not sizes:
        raise SystemExit(f"plot_ddp_transformer: no runs in {o.dir}")

    lines = ["| ranks | side | step time (ms), per seed | mean | state bytes / rank | final loss, per seed | "
             "replicas identical |", "|---|---|---|---|---|---|---|"]
    checks = []
    for n in sizes:
        g, d = runs.get(("gradapt", n), {}), runs.get(("ddp", n), {})
        for side, rs in (("gradapt", g), ("DDP", d)):
            if not rs:
                continue
            seeds = sorted(rs)
            ms = [rs[s][0]["step_ms"] for s in seeds]
            finals = ", ".join(f"{rs[s][0]['final_loss']:.4f}" for s in seeds)
            lines.append(
                f"| {n} | {side} | {', '.join(f'{x:.1f}' for x in ms)} | {sum(ms) / len(ms):.1f} | "
                f"{max(rs[s][0]['state_bytes'] for s in seeds):,} | "
                f"{finals} | "
                f"{', '.join(rs[s][0]['identical'] for s in seeds)} |")
        common = sorted(set(g) & set(d))
        if not common:
            continue
        mg = sum(g[s][0]["step_ms"] for s in common) / len(common)
        md = sum(d[s][0]["step_ms"] for s in common) / len(common)
        paired = [g[s][0]["step_ms"] / d[s][0]["step_ms"] for s in common]
        bytes_ratio = max(g[s][0]["state_bytes"] for s in common) / max(d[s][0]["state_bytes"] for s in common)
        sg = {s: smooth(g[s][1]) for s in common}
        sd = {s: smooth(d[s][1]) for s in common}
        spreads = []
        for curves in (sg, sd):
            pairs = list(itertools.combinations(sorted(curves), 2))
            if pairs:
                spreads.append(max(max_gap(curves[a], curves[b]) for a, b in pairs))
        spread = min(spreads) if spreads else None
        same_seed = max(max_gap(sg[s], sd[s]) for s in common)
        mean_g = [sum(v) / len(common) for v in zip(*(sg[s] for s in common))]
        mean_d = [sum(v) / len(common) for v in zip(*(sd[s] for s in common))]
        means_gap = max_gap(mean_g, mean_d)
        checks.append(
            f"- {n} ranks: step time gradapt/DDP {mg / md:.3f} (per seed {', '.join(f'{r:.3f}' for r in paired)}; "
            f"floor <= 1.0: {'met' if mg / md <= 1.0 else 'NOT met'}); optimizer state per rank gradapt/DDP "
            f"{bytes_ratio:.3f}{' (floor <= 0.6 at 4 ranks: ' + ('met' if bytes_ratio <= 0.6 else 'NOT met') + ')' if n == 4 else ''}; "
            f"loss curves: spread {'n/a (one seed)' if spread is None else f'{spread:.4f}'}, gap same seed "
            f"{same_seed:.4f}, gap seed means {means_gap:.4f}"
            + ("" if spread is None else
               f" ({'within' if max(same_seed, means_gap) <= spread else 'NOT within'} the spread)"))
    breakdowns = [f"- {side} {n} ranks, seed {seed}: {v[0]['breakdown']}" for (side, n), rs in sorted(runs.items())
                  for seed, v in sorted(rs.items())]
    recipes = sorted({v[0]["recipe"] for rs in runs.values() for v in rs.values()})
    text = "\n".join(["Recipes: " + "; ".join(recipes), "", *lines, "", *checks, "",
                      "Where the time goes (mean per step after the warm-up, slowest rank):", *breakdowns, ""])
    if o.summary:
        with open(o.summary, "w") as f:
            f.write(text)
    else:
        print(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for side, color, style in (("gradapt", "tab:blue", "-"), ("ddp", "tab:orange", "--")):
            for k, (seed, (_, loss)) in enumerate(sorted(runs.get((side, n), {}).items())):
                label = f"{'gradapt ZeRO-2' if side == 'gradapt' else 'PyTorch DDP'}, seed {seed}"
                ax.plot(range(1, len(loss) + 1), smooth(loss), style, color=color, alpha=1.0 - 0.35 * k,
                        linewidth=1.3, label=label)
        ax.set_title(f"{n} ranks")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(f"loss (mean over ranks, {SMOOTH}-step average)")
    fig.suptitle("Character transformer (3.3 M parameters): gradapt's composed step vs PyTorch DDP, same seeds")
    fig.tight_layout()
    os.makedirs(os.path.dirname(o.png) or ".", exist_ok=True)
    fig.savefig(o.png, dpi=110)
    print(f"wrote {o.png}")


if __name__ == "__main__":
    main()
