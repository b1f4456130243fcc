#!/usr/bin/env python3
"""torch.optim.Adafactor on the tensors bench_factored.cpp uses.

The same GPT-2-small-shaped list (148 tensors, 101.2M fp32 parameters), the same thread count,
lr 1e-3 and torch's other defaults, timed the way bench_factored times gradapt: a warm-up step,
then the median of `rounds` steps, each preceded by the same triad loop (a = b + 0.5 c over
three arrays of the parameter count) so both programs see the same cache state; the triad's
bandwidth is printed as a check of the machine's state during the run.

Compare its rows with bench_factored's "adafactor_torch" row (gradapt with torch's options:
relative step, last-two factoring of every matrix, eps1 as a clamp) and "adafactor" row
(optax's defaults; same passes). Issue 5: gradapt's Adafactor step <= 1.0x torch's.

    python3 bench/bench_factored_torch.py [rounds=9] [threads=2]
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
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
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
        ("Adafactor foreach", lambda: torch.optim.Adafactor(params, lr=1e-3, foreach=True)),
        ("Adafactor for-loop", lambda: torch.optim.Adafactor(params, lr=1e-3, foreach=False)),
    ]
    for name, make in configs:
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
        print("%-26s %10.1f %10.1f %12.1f" % (name, t * 1e3, 12.0 * n / t * 1e-9, statistics.median(triads) * 1e-9))
        del opt


if __name__ == "__main__":
    main()
