#!/usr/bin/env python3
"""PyTorch's CPU AdamW (and SGD with momentum) on the tensors bench_optim.cpp uses.

The same GPT-2-small-shaped list (148 tensors, 101.2M fp32 parameters), the same thread count,
the same options (lr 1e-4, weight decay 0.01; betas, eps at their defaults), timed the way
bench_optim times gradapt: a warm-up step, then the median of `rounds` steps. Each step is
preceded by the same triad loop as bench_optim (a = b + 0.5 c over three arrays of the same
element count, through torch) so the two programs see the same cache state, and the triad's
bandwidth is printed as a sanity check of the machine's state during the run.

Run it in the same session as bench_optim and compare the AdamW rows (gradapt's AdamW
step <= 1.0x PyTorch's, foreach or fused):

    python3 bench/bench_optim_torch.py [rounds=15] [threads=2]
"""

import statistics
import sys
import time

import torch


def shapes():
    d, vocab, positions, layers = 768, 20000, 1024, 12
    s = [(vocab, d), (positions, d)]
    for _ in range(layers):
        s += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    s += [(d,), (d,)]
    return s


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    sh = shapes()
    n = sum(torch.Size(s).numel() for s in sh)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in sh]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    ta, tb, tc = torch.ones(n), torch.full((n,), 2.0), torch.full((n,), 0.5)

    def triad():
        torch.add(tb, tc, alpha=0.5, out=ta)

    print("torch %s, %d threads, %d tensors, %.1fM parameters, %d rounds (medians)" % (
        torch.__version__, torch.get_num_threads(), len(params), n / 1e6, rounds))
    print("%-26s %10s %10s %12s" % ("step", "ms", "eff GB/s", "triad GB/s"))
    configs = [
        ("AdamW foreach", lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True), 28),
        ("AdamW fused", lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True), 28),
        ("AdamW for-loop", lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False), 28),
        ("SGD momentum foreach", lambda: torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True), 20),
    ]
    for name, make, bytes_per_param in configs:
        opt = make()
        opt.step()  # warm-up: allocates the state
        steps, triads = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            triad()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            triads.append(12.0 * n / (t1 - t0))
            steps.append(t2 - t1)
        t = statistics.median(steps)
        print("%-26s %10.1f %10.1f %12.1f" % (name, t * 1e3, bytes_per_param * n / t * 1e-9,
                                              statistics.median(triads) * 1e-9))
        del opt


if __name__ == "__main__":
    main()
