#!/usr/bin/env python3
"""Meta's Distributed Shampoo (facebookresearch/optimizers) on bench_shampoo.cpp's workload.

bench_shampoo's parameter list (8 layers of d = 512: four 512 x 512 attention matrices, 512 x 2048
and 2048 x 512 MLP matrices, two 512 norm vectors per layer; 25.2M float32 parameters, zero at
the start; fixed N(0, 1) gradients drawn once from a seeded generator), max_preconditioner_dim
1024 (64 blocks), lr 1e-4, one thread, CPU. Each optimizer is one DistributedShampoo with two
parameter groups: the 48 matrices, and the 16 norm vectors, which take the graft's method alone
(gradapt's treatment of 1-D tensors). Options map as in tests/data/make_shampoo_refs.py.
Calls are timed one by one with time.perf_counter (wall) and
time.thread_time (CPU of this thread, where torch's single thread runs); rows print the median
and minimum wall seconds and the median CPU seconds.

Install the peer at the commit the references pin (once):

    python3.12 -m venv /tmp/shref && /tmp/shref/bin/pip install torch numpy
    git clone https://github.com/facebookresearch/optimizers /tmp/fbopt
    git -C /tmp/fbopt checkout f60660661194de26d3ee78bae6d15820ff8e583d
    /tmp/shref/bin/pip install /tmp/fbopt

Run it back to back with bench_shampoo, on an idle machine (the script sets one torch thread;
torch's BLAS/LAPACK is MKL, so OPENBLAS_NUM_THREADS only matters to bench_shampoo):

    OPENBLAS_NUM_THREADS=1 /tmp/shref/bin/python bench/bench_shampoo_torch.py [steps=6] [repeats=3]
    OPENBLAS_NUM_THREADS=1 build/default/bench/bench_shampoo \\
        --benchmark_filter="step_throughput|async_overhead|family_steps|eigenbasis_refresh"

Rows, and the bench_shampoo counters they compare with:
  gemm_gflops   torch.mm 1024 x 1024 float32, 10 after a warm-up       gemm_gflops
  step          Shampoo step, no roots: statistics, two mode products  step_throughput's Time
                per block, AdaGrad graft; `steps` steps after the      (its CPU: cpu), gflops,
                first (which computes the roots). gflops: with         ratio; family_steps
                bench_shampoo's FLOP count                             shampoo_s; async off_s
  step_packed   the same with the peer's default symmetric packing     (as step)
                (step stores full matrices, as gradapt does)
  roots         one root computation of all 64 blocks (128 eigh        async_overhead roots_s
                roots): the peer's amortized computation called
                directly, as its update_preconditioners calls it
  roots_step1   first step minus median step (roots_s's definition)   async_overhead roots_s
  soap_step     eigenvalue-corrected step, eigh bases of step 1        family_steps soap_s
                never refreshed                                        (soap_ratio)
  eigh_refresh  one eigh refresh of all bases (direct call)            eigenbasis_refresh eigh_s
  qr_refresh    one warm-started QR iteration on all bases (direct)    eigenbasis_refresh qr_s
  muon_step     spectral descent, 5 Newton-Schulz steps per block,     family_steps muon_s,
                aspect-scaled; the vectors by Adam                     muon_gemm_s, muon_ratio
"""

import logging
import math
import statistics
import sys
import time

import torch

import distributed_shampoo as ds
from distributed_shampoo.shampoo_types import SHAMPOO_PRECONDITIONER_LIST

LAYERS, D, CAP, LR = 8, 512, 1024, 1e-4
NEVER = 10**6  # precondition_frequency set after construction: roots / bases at step 1 only
# gradapt's default root ridge is relative, 1e-6 * lambda_max; the peer's eigen root takes an
# absolute one. lambda_max of these one-step factors (G G^T of an N(0,1) 512 x 512 or 512 x 1024
# block) is about 2000-3000, so 2e-3 is the same order; the ridge does not change the work.
ROOT_EPS = 2e-3


def shapes():
    s = []
    for _ in range(LAYERS):
        s += [(D, D)] * 4 + [(D, 4 * D), (4 * D, D), (D,), (D,)]
    return s


def blocks(shape):
    """(rows, cols) of each max_preconditioner_dim block of a matrix."""
    return [(min(CAP, shape[0] - r), min(CAP, shape[1] - c))
            for r in range(0, shape[0], CAP) for c in range(0, shape[1], CAP)]


def shampoo_flops():
    """bench_shampoo's count per step: SYRK m^2 n + n^2 m, mode products 2 m^2 n + 2 m n^2."""
    return sum(m * m * k + k * k * m + 2 * m * m * k + 2 * m * k * k
               for s in shapes() if len(s) == 2 for m, k in blocks(s))


def newton_schulz_flops():
    """bench_shampoo's count per step: 5 x (SYRK k^2 l + A.A 2k^3 + B.X 2k^2 l), k = min side."""
    return sum(5 * (min(a, b) ** 2 * max(a, b) * 3 + 2 * min(a, b) ** 3)
               for s in shapes() if len(s) == 2 for a, b in blocks(s))


class Model:
    """Zero parameters with fixed seeded gradients, split into matrices and vectors."""

    def __init__(self):
        gen = torch.Generator().manual_seed(3)
        self.mats, self.vecs = [], []
        for s in shapes():
            p = torch.nn.Parameter(torch.zeros(s, dtype=torch.float32))
            p.grad = torch.randn(s, generator=gen, dtype=torch.float32)
            (self.mats if len(s) == 2 else self.vecs).append(p)
        self.grad0 = float(self.mats[0].grad.abs().sum())

    def size(self):
        return sum(p.numel() for p in self.mats + self.vecs)

    def check(self):
        """The steps left finite parameters and untouched gradients (sane numbers were timed)."""
        assert all(bool(torch.isfinite(p).all()) for p in self.mats + self.vecs)
        assert float(self.mats[0].grad.abs().sum()) == self.grad0


def no_merge():
    # gradapt merges from the first dimension; the peer is handed the shape and merges nothing
    # (none of these 2-D shapes would merge either way).
    return ds.SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf)


def first_only(opt):
    """The peer rejects start_preconditioning_step < precondition_frequency, so the matrices'
    group is built with both 1 and its frequency raised afterwards: the step reads it from the
    group each time, and computes roots / bases at t == 1 only (t % 10^6 != 0 after that)."""
    opt.param_groups[0]["precondition_frequency"] = NEVER
    return opt


def shampoo(m, packing):
    """bench_shampoo's options(): graft AdaGrad (eps 1e-10), summed statistics, no first moment,
    no bias correction, eigen roots (p = 4 for a matrix), roots at step 1 only."""
    graft = ds.AdaGradPreconditionerConfig(epsilon=1e-10)
    root = ds.RootInvShampooPreconditionerConfig(amortized_computation_config=ds.EigenConfig(),
                                                 use_symmetric_packing=packing)
    return first_only(ds.DistributedShampoo(
        [dict(params=m.mats, epsilon=ROOT_EPS, grafting_config=graft, preconditioner_config=root),
         dict(params=m.vecs, epsilon=1e-12, grafting_config=None, preconditioner_config=graft)],
        lr=LR, betas=(0.0, 1.0), use_bias_correction=False, max_preconditioner_dim=CAP,
        precondition_frequency=1, start_preconditioning_step=1, distributed_config=no_merge()))


def soap(m, bases):
    """bench_shampoo's soap_options(): eigenvalue-corrected, beta2 0.999 for the factors and the
    corrected eigenvalues, absolute epsilon 1e-8, no graft (vectors: SGD), no first moment, no
    bias correction, corrected exponent 1/2; bases at step 1 only."""
    cfg = ds.EigenvalueCorrectedShampooPreconditionerConfig(amortized_computation_config=bases,
                                                            use_symmetric_packing=False)
    return first_only(ds.DistributedShampoo(
        [dict(params=m.mats, epsilon=1e-8, preconditioner_config=cfg),
         dict(params=m.vecs, epsilon=1e-12, preconditioner_config=ds.SGDPreconditionerConfig())],
        lr=LR, betas=(0.0, 0.999), use_bias_correction=False, max_preconditioner_dim=CAP,
        precondition_frequency=1, start_preconditioning_step=1, grafting_config=None,
        distributed_config=no_merge()))


def aspect(d_in, d_out):  # sqrt(max(1, rows / cols)) per block (gradapt's scale_by_aspect)
    return max(1.0, d_out / d_in) ** 0.5


def muon(m):
    """bench_shampoo's spectral_descent_defaults() with lr 1e-4, scale_by_aspect and the Adam
    graft (beta2 0.999, eps 1e-10) for the vectors only: beta1 0.9 with bias correction, 5
    Newton-Schulz steps of (3.4445, -4.7750, 2.0315) per 2-D block, matrices not grafted."""
    orth = ds.NewtonSchulzOrthogonalizationConfig(scale_by_dims_fn=aspect)
    return ds.DistributedShampoo(
        [dict(params=m.mats,
              preconditioner_config=ds.SpectralDescentPreconditionerConfig(orthogonalization_config=orth),
              distributed_config=ds.SingleDeviceDistributedConfig(target_parameter_dimensionality=2)),
         dict(params=m.vecs, preconditioner_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-10),
              distributed_config=no_merge())],
        lr=LR, betas=(0.9, 1.0), use_bias_correction=True, epsilon=1e-12, max_preconditioner_dim=CAP,
        precondition_frequency=1, start_preconditioning_step=1, grafting_config=None)


def seconds(fn):
    """(wall, this thread's CPU) seconds of fn()."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def amortized(opt):
    """The peer's amortized computation of the matrices' group, as its update_preconditioners
    runs it on a step where it is due: per block, the factors over the bias correction, then
    eigh roots (Shampoo) or eigh / QR eigenvectors (eigenvalue-corrected)."""
    pl = opt._per_group_state_lists[0][SHAMPOO_PRECONDITIONER_LIST]
    for kf in pl._masked_kronecker_factors_unwrapped:
        kf.amortized_computation(bias_correction2=pl._bias_correction2)


def factors(opt):
    """(blocks, factor matrices) of the matrices' group."""
    kfs = opt._per_group_state_lists[0][SHAMPOO_PRECONDITIONER_LIST]._masked_kronecker_factors_unwrapped
    return len(kfs), sum(len(kf.factor_matrices) for kf in kfs)


def run_steps(opt, n):
    """(the first step's times, the times of the n steps after it)."""
    first = seconds(opt.step)
    return first, [seconds(opt.step) for _ in range(n)]


def wall(ts):
    return statistics.median(t[0] for t in ts)


def gemm_gflops():
    n = 1024
    a, b, c = torch.full((n, n), 0.5), torch.full((n, n), 0.25), torch.empty(n, n)
    torch.mm(a, b, out=c)
    t = seconds(lambda: [torch.mm(a, b, out=c) for _ in range(10)])[0]
    return 2.0 * n ** 3 * 10 / t / 1e9


def row(name, ts, extra="", compare=""):
    """Prints ts [(wall, cpu)]: median and minimum wall, median CPU; returns the median wall."""
    print("%-13s %8.4f %8.4f %8.4f %2d  %-33s %s" % (
        name, wall(ts), min(t[0] for t in ts), statistics.median(t[1] for t in ts), len(ts), extra, compare),
        flush=True)
    return wall(ts)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)  # its configuration notices
    print("torch %s, %d thread, %.1fM float32 parameters, %d steps, %d repeats (seconds)" % (
        torch.__version__, torch.get_num_threads(), Model().size() / 1e6, steps, repeats))
    print("%-13s %8s %8s %8s %2s  %-33s %s" % ("row", "median", "min", "cpu", "n", "", "bench_shampoo counter"))
    ref = gemm_gflops()
    print("%-13s %8s %8s %8s %2d  %-33s %s" % ("gemm_gflops", "-", "-", "-", 10,
                                               "%.1f GFLOP/s (torch.mm 1024^2)" % ref, "gemm_gflops"), flush=True)
    flops = shampoo_flops()

    # Shampoo: the step without roots, then the roots; full matrices, as gradapt keeps them.
    m = Model()
    opt = shampoo(m, packing=False)
    nb, nf = factors(opt)
    assert nb == 64 and nf == 128, (nb, nf)
    first, ts = run_steps(opt, steps)
    sh = wall(ts)
    row("step", ts, "%.1f GFLOP/s, ratio %.3f" % (flops / sh / 1e9, flops / sh / 1e9 / ref),
        "step_throughput Time (CPU: cpu), gflops, ratio; family_steps shampoo_s; async_overhead off_s")
    row("roots", [seconds(lambda: amortized(opt)) for _ in range(repeats)], "%d blocks, %d eigh roots" % (nb, nf),
        "async_overhead roots_s")
    row("roots_step1", [(first[0] - sh, first[1] - statistics.median(t[1] for t in ts))],
        "first step %.3f s" % first[0], "async_overhead roots_s (its definition)")
    m.check()

    m = Model()
    opt = shampoo(m, packing=True)
    ts = run_steps(opt, steps)[1]
    row("step_packed", ts, "%.1f GFLOP/s, ratio %.3f" % (flops / wall(ts) / 1e9, flops / wall(ts) / 1e9 / ref),
        "(as step; the peer's default packing)")
    m.check()

    # Eigenvalue-corrected Shampoo with eigh bases: steps without a refresh, then refreshes.
    m = Model()
    opt = soap(m, ds.EighEigendecompositionConfig())
    ts = run_steps(opt, steps)[1]
    row("soap_step", ts, "soap/step %.3f" % (wall(ts) / sh), "family_steps soap_s (soap_ratio)")
    eigh = row("eigh_refresh", [seconds(lambda: amortized(opt)) for _ in range(repeats)],
               "%d blocks, %d eigh" % factors(opt), "eigenbasis_refresh eigh_s")
    m.check()

    # One QR iteration per refresh, warm-started from the current bases (step 1 computes them
    # from the identity, each refresh after that from the previous ones).
    m = Model()
    opt = soap(m, ds.QREigendecompositionConfig(max_iterations=1, tolerance=0.0))
    opt.step()
    qr = [seconds(lambda: amortized(opt)) for _ in range(repeats)]
    row("qr_refresh", qr, "qr/eigh %.3f" % (wall(qr) / eigh), "eigenbasis_refresh qr_s (ratio)")
    m.check()

    m = Model()
    opt = muon(m)
    ts = run_steps(opt, steps)[1]
    gemm_s = newton_schulz_flops() / (ref * 1e9)
    row("muon_step", ts, "muon_gemm_s %.4f, ratio %.3f" % (gemm_s, wall(ts) / gemm_s),
        "family_steps muon_s, muon_gemm_s, muon_ratio")
    m.check()


if __name__ == "__main__":
    main()
