#!/usr/bin/env python3
"""Per-rank optimizer state memory of shard::sharded_optimizer against the rank count.

Runs `bench_shard --memory-csv` (the memory part of bench/bench_shard.cpp: per-rank
`sharded_state::state_bytes()` on the GPT-2-small list, 101.2M parameters, for 1 to 64 ranks,
from the partition plan and checked against sharded states created on comm::threads for
N <= 8), writes its CSV and a log-log plot of the largest rank's state against N:

  - AdamW, fp32 parameters (m and v: 8 B per shard element), measured
  - AdamW, bfloat16 parameters with float master values (`init<float>`: 12 B), measured
  - ZeRO stage 1's K Psi / N with K = 8 and K = 12 (Rajbhandari et al. 2020)
  - Adafactor (whole tensors per rank, longest-processing-time by elements), measured, and
    its unsharded state / N

    python3 bench/plot_shard_memory.py [path/to/bench_shard] [output directory]

Defaults: build/bench/bench_shard and docs/algorithms/img (shard_memory.csv, shard_memory.png).
Needs matplotlib (`pip install matplotlib`).
"""

import csv
import io
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build", "bench", "bench_shard")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "docs", "algorithms", "img")
    text = subprocess.run([exe, "--memory-csv"], check=True, capture_output=True, text=True).stdout
    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "shard_memory.csv")
    with open(csv_path, "w", newline="") as f:
        f.write(text)

    rows = list(csv.DictReader(io.StringIO(text)))
    by = {}
    for r in rows:
        by.setdefault(r["optimizer"], []).append(r)
    psi = float(rows[0]["params"])
    mb = 1e-6

    def series(name, field):
        xs, ys = [], []
        for r in by[name]:
            if r[field]:
                xs.append(int(r["ranks"]))
                ys.append(float(r[field]) * mb)
        return xs, ys

    fig, ax = plt.subplots(figsize=(10.0, 5.0))
    styles = [
        ("adamw_bf16_master", "AdamW, bf16 params + fp32 master", "tab:red"),
        ("adamw_fp32", "AdamW, fp32 params", "tab:blue"),
    ]
    for name, label, color in styles:
        x, y = series(name, "plan_max_bytes")
        ax.plot(x, y, "-", color=color, lw=1.5, label=f"{label} (plan, max over ranks)")
        xm, ym = series(name, "measured_max_bytes")
        ax.plot(xm, ym, "o", color=color, ms=6, mfc="none", label=f"{label}: state_bytes() measured")
        xz, yz = series(name, "zero_formula_bytes")
        k = round(float(by[name][0]["zero_formula_bytes"]) / psi)
        ax.plot(xz, yz, ":", color=color, lw=2.5, alpha=0.6, label=f"ZeRO K\u03a8/N, K = {k}")
    x, y = series("adafactor_fp32", "plan_max_bytes")
    ax.plot(x, y, "-", color="tab:green", lw=1.5, label="Adafactor, whole tensors (plan, max over ranks)")
    xm, ym = series("adafactor_fp32", "measured_max_bytes")
    ax.plot(xm, ym, "o", color="tab:green", ms=6, mfc="none", label="Adafactor: state_bytes() measured")
    un = float(by["adafactor_fp32"][0]["unsharded_bytes"]) * mb
    ax.plot(x, [un / n for n in x], ":", color="tab:green", lw=2.5, alpha=0.6, label="Adafactor unsharded / N")

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([str(n) for n in x])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("optimizer state per rank (MB)")
    ax.set_title(f"ZeRO stage 1 state per rank, GPT-2-small list (\u03a8 = {psi / 1e6:.1f}M)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    png_path = os.path.join(out, "shard_memory.png")
    fig.savefig(png_path, dpi=120, bbox_inches="tight")
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
