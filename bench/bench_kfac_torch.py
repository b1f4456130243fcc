#!/usr/bin/env python3
"""kfac-pytorch (KAISA, kfac.preconditioner.KFACPreconditioner) on bench_kfac.cpp's workload.

The same 24 nn.Linear layers with a bias (4 blocks of d = 256: q, k, v, o 256 -> 256, up
256 -> 1024, down 1024 -> 256; 3.2M weights), float32, 512 rows of a and g per layer, one
thread, and bench_kfac's gradapt::kfac options: eigen, damping 1e-3, factor_decay 0.95,
kl_clip 1e-3, eigenvalues divided at each step (compute_eigenvalue_outer_product=False, as
gradapt's prediv_eigenvalues = false), accumulation_steps 1, one process (no torch.distributed).
Each layer is applied to its own fixed N(0, 1) input x (512 x in) and the loss is the sum of
(y * r) with a fixed N(0, 1) r (512 x out), so the hooks capture a = x and g = r, as
bench_kfac feeds N(0, 1) a and g. The schedule matches gradapt's: kfac-pytorch's step k
(from 0) updates factors when k % factor_update_steps == 0 and decomposes when
k % inv_update_steps == 0, gradapt's step t = k + 1 when (t - 1) % ... == 0.

What is timed (time.perf_counter). kfac-pytorch computes each layer's aT.a / rows and
gT.g / rows inside its forward / backward hooks (KFACBaseLayer.save_layer_input and
save_layer_grad_output), outside step(); gradapt does the same products (two SYRKs per layer)
in kfac::accumulate, which bench_kfac times together with the step. So those two methods are
wrapped with a timer on every layer ("hooks" below), forward/backward themselves are not
timed, and update_factors_in_hook=False moves kfac-pytorch's running average into step(), as
gradapt's step does it. A factor-update step costs hooks + step().

Rows (columns: hooks ms = the factor products in the hooks, step() ms, total = their sum), and
the bench_kfac counter each one compares with:
  plain step       step() with no factor update and no decomposition (decomposed once before),
                   median of `rounds`. No counter of its own: products' precondition_s is this
                   plus the O(n^2) running average of the factors.
  factor step      a factor-update step without decomposition, median of `rounds`:
                   step() ms (running average + preconditioning)  <->  products precondition_s;
                   total ms and GFLOP/s (on bench_kfac's own FLOP count, the SYRKs counted
                   once although kfac-pytorch does full GEMMs)   <->  products gflops.
  decompose step   the first step of the amortised cycle (factors, eigh of every A and G,
                   preconditioning), total ms                    <->  amortised decompose_s;
                   "of which eigh" = the compute_a_inv / compute_g_inv calls alone.
  amortised        mean per step of a 100-step cycle, factors every 10, decompositions every
                   100, hooks included                           <->  amortised kfac_per_step_s.
The plain and factor rows interleave the two kinds of step with factor_update_steps=2 and no
decomposition after the first step (bench_kfac's products updates factors every step and uses
inv_update_steps = 1000000); the amortised cycle uses exactly 10 / 100 on a fresh
preconditioner, as bench_kfac's amortised does.

Run it back to back with bench_kfac on an otherwise idle machine, one thread each:

    OPENBLAS_NUM_THREADS=1 /tmp/shref/bin/python bench/bench_kfac_torch.py [rounds=10] [cycles=1]
    OPENBLAS_NUM_THREADS=1 build/default/bench/bench_kfac --benchmark_filter="products|amortised"

torch does its BLAS and LAPACK through MKL (torch.set_num_threads(1) below), gradapt through
OpenBLAS: the comparison is of the two libraries as shipped, not of one BLAS.

Set up (PyPI served no kfac-pytorch to this machine: pip's index answered 404 for it, so it
was installed from the source of the project's v0.4.2 release tag):
    # /tmp/shref: an existing Python 3.12 venv with torch 2.15.0 (CPU use only)
    mkdir -p /tmp/kfac-src
    git -C <clone of github.com/gpauloski/kfac-pytorch> archive v0.4.2 | tar -x -C /tmp/kfac-src
    SETUPTOOLS_SCM_PRETEND_VERSION=0.4.2 /tmp/shref/bin/pip install --no-deps /tmp/kfac-src
Measured with kfac-pytorch 0.4.2 (tag v0.4.2, commit c74701346cf5; its only dependency is
torch>=2). Where PyPI serves it, `/tmp/shref/bin/pip install --no-deps kfac-pytorch==0.4.2`
is the ordinary way to install that release.
"""

import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*Apex.*")
warnings.filterwarnings("ignore", message=".*Full backward hook.*")
import kfac  # noqa: E402  (after the filters: it warns on import when Apex is absent)
import kfac.preconditioner  # noqa: E402

ROWS = 512
OPTIONS = dict(damping=1e-3, factor_decay=0.95, kl_clip=1e-3, compute_method="eigen",
               compute_eigenvalue_outer_product=False, accumulation_steps=1,
               update_factors_in_hook=False, inv_dtype=torch.float32)


def layer_shapes(blocks=4, d=256):
    s = []
    for l in range(blocks):
        s += [("block%d.%s" % (l, n), d, d) for n in ("q", "k", "v", "o")]
        s += [("block%d.up" % l, d, 4 * d), ("block%d.down" % l, 4 * d, d)]
    return s


def product_flops():
    """bench_kfac's count: SYRKs as r.n^2 each, preconditioning 2(2o^2 n + 2o n^2)."""
    f = 0.0
    for _, i, o in layer_shapes():
        n = i + 1
        f += ROWS * n * n + ROWS * o * o + 2 * (2 * o * o * n + 2 * o * n * n)
    return f


class Bench:
    """24 Linear layers, each on its own fixed input; a preconditioner with timed internals."""

    def __init__(self, seed, lr, **steps):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = torch.nn.Module()
        for name, i, o in layer_shapes():
            self.model.add_module(name.replace(".", "_"), torch.nn.Linear(i, o, bias=True))
        self.x = [torch.randn(ROWS, m.in_features, generator=gen) for m in self.model.children()]
        self.r = [torch.randn(ROWS, m.out_features, generator=gen) for m in self.model.children()]
        self.pre = kfac.preconditioner.KFACPreconditioner(self.model, lr=lr, **OPTIONS, **steps)
        assert len(self.pre._layers) == 24
        self.acc = {"hooks": 0.0, "eigh": 0.0}
        for _, layer in self.pre._layers.values():
            for meth, key in (("save_layer_input", "hooks"), ("save_layer_grad_output", "hooks"),
                              ("compute_a_inv", "eigh"), ("compute_g_inv", "eigh")):
                setattr(layer, meth, self._timed(getattr(layer, meth), key))
        self.params = list(self.model.parameters())
        self.grads0 = None

    def _timed(self, fn, key):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.acc[key] += time.perf_counter() - t0
            return out
        return wrapped

    def factors_due(self):
        return self.pre.steps % self.pre.factor_update_steps == 0

    def prepare(self):
        """Fresh gradients; forward/backward (untimed but for the hooks) on factor steps."""
        if self.factors_due() or self.grads0 is None:
            self.model.zero_grad(set_to_none=True)
            loss = sum((m(x) * r).sum() for m, x, r in zip(self.model.children(), self.x, self.r))
            loss.backward()
            if self.grads0 is None:
                self.grads0 = [p.grad.clone() for p in self.params]
        else:
            for p, g in zip(self.params, self.grads0):
                p.grad = g.clone()

    def step(self):
        """One step; returns (hooks' factor time, step() time, eigh time) in seconds."""
        self.acc["hooks"] = self.acc["eigh"] = 0.0
        self.prepare()
        t0 = time.perf_counter()
        self.pre.step()
        s = time.perf_counter() - t0
        for p in self.params:
            assert torch.isfinite(p.grad).all()
        return self.acc["hooks"], s, self.acc["eigh"]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    cycles = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    print("kfac-pytorch %s, torch %s, %d thread, 24 Linear layers, %d rows, float32" % (
        kfac.__version__, torch.__version__, torch.get_num_threads(), ROWS))
    print("%-20s %11s %11s %11s %9s" % ("step", "hooks ms", "step() ms", "total ms", "GFLOP/s"))

    def row(name, h, s, extra=""):
        print("%-20s %11.2f %11.2f %11.2f %9s" % (name, h * 1e3, s * 1e3, (h + s) * 1e3, extra))

    # Plain and factor-update steps, interleaved; the first step decomposes (not measured).
    b = Bench(9, lr=0.1, factor_update_steps=2, inv_update_steps=1000000)
    b.step()
    plain, fac = [], []
    for _ in range(2 * rounds):
        due = b.factors_due()
        h, s, e = b.step()
        assert e == 0.0 and (h > 0) == due
        (fac if due else plain).append((h, s))
    row("plain step", 0.0, statistics.median(s for _, s in plain))
    hs, ss = statistics.median(h for h, _ in fac), statistics.median(s for _, s in fac)
    tot = statistics.median(h + s for h, s in fac)
    row("factor step", hs, ss, "%.1f" % (product_flops() / tot / 1e9))

    # bench_kfac's amortised: one cycle of 100 steps per round on a fresh preconditioner.
    b = Bench(9, lr=0.01, factor_update_steps=10, inv_update_steps=100)
    means, dec, eig = [], [], []
    for _ in range(cycles):
        total = 0.0
        for t in range(100):
            h, s, e = b.step()
            total += h + s
            if t == 0:
                assert e > 0
                dec.append((h, s))
                eig.append(e)
        means.append(total / 100)
    h, s = dec[0] if cycles == 1 else (statistics.median(x for x, _ in dec),
                                         statistics.median(y for _, y in dec))
    row("decompose step", h, s, "")
    print("%-20s %11s %11.2f %11s" % ("  of which eigh", "", statistics.median(eig) * 1e3, ""))
    print("%-20s %11s %11s %11.2f   (mean per step, %d cycle%s)" % (
        "amortised", "", "", statistics.median(means) * 1e3, cycles, "" if cycles == 1 else "s"))


if __name__ == "__main__":
    main()
