#!/usr/bin/env python3
"""Reference trajectories for gradapt's Shampoo (tests/test_shampoo_refs.cpp), from
facebookresearch/optimizers' DistributedShampoo, an implementation independent of gradapt.

Usage (not run by CI; the outputs under tests/data/shampoo/ are committed):

    python3.12 -m venv /tmp/shref && /tmp/shref/bin/pip install torch numpy
    git clone <facebookresearch/optimizers> /tmp/fbopt && git -C /tmp/fbopt checkout f60660661194de26d3ee78bae6d15820ff8e583d
    /tmp/shref/bin/pip install /tmp/fbopt        # the package torch-shampoo 1.0.0 (Python >= 3.12)
    /tmp/shref/bin/python tests/data/make_shampoo_refs.py   # writes tests/data/shampoo/*.txt

Inputs are not stored: parameters and gradients come from the counter-based generator of
peer_refs.py (make_optim_refs.py's), which the C++ test reproduces bit for bit (every value exact in float32;
gradients do not depend on the parameters). Each file holds the case's gradapt options (the
peer's configuration follows from them by the mapping below), the tensors, the block plan
(gradapt's merged shape and the number of blocks the peer's own splitting cuts it into), and the
peer's float64 parameters after the
first step, the first preconditioned step, the 16th and the 32nd (every element), plus:
  scale          the largest |p_last - p_0| of the float64 run: the unit of every difference;
  peer_float32   how far the peer's own float32 run lands from its float64 run (in scale units,
                 all recorded steps): the size of float32 rounding over the trajectory, from
                 which the C++ test sets its float tolerance;
  sensitivity    how far deliberately wrong configurations of the peer land from the reference
                 (in scale units), so the test can check its tolerances separate right from wrong;
                 sensitivity_double: variants that only the double comparison is to resolve (the
                 eigen root in place of coupled Newton, whose result is within Newton's tolerance).

Option mapping (gradapt shampoo_options -> DistributedShampoo):
  lr                          -> lr; the peer keeps it in a float32 tensor, so every case uses a
                                 power of two (exact in float32)
  beta2 (1 = sum, < 1 = EMA)  -> betas=(0, beta2): factor matrices beta2*S + w*G G^T with w = 1
                                 for beta2 = 1 and 1 - beta2 otherwise; use_bias_correction=False
                                 (the peer's bias correction divides the EMA by 1 - beta2^t before
                                 the root, which gradapt does not do: a wrong variant below);
                                 betas[0] = 0 (the peer's gradient EMA before preconditioning has
                                 no gradapt counterpart)
  statistics_frequency 1      -> the peer updates the factor matrices every step
  precondition_frequency f,   -> precondition_frequency f, start_preconditioning_step s; the peer
  start_preconditioning_step s   computes roots at t == s and at t > s with t % f == 0, gradapt at
                                 t >= s with (t - s) % f == 0: the same steps when s % f == 0
                                 (every case here); steps before s take the graft in both
  root: eigen, absolute ridge -> RootInvShampooPreconditionerConfig(EigenConfig()), epsilon=eps:
                                 (S + eps I)^(-1/p) (the peer adds eps before eigh and shifts the
                                 spectrum up if rounding left an eigenvalue below eps; gradapt
                                 takes (max(lambda, 0) + eps)^(-1/p))
  root: coupled Newton        -> CoupledNewtonConfig(tolerance, max_iterations): the same iteration
                                 (z = (p+1)/(2 |A|_F), X0 = z^(1/p) I, M0 = z A, stop at
                                 max|M - I| <= tolerance)
  inverse exponent p = 2k     -> the peer's default 1/(2 * order) for a block of order k
  max_preconditioner_dim      -> max_preconditioner_dim: both cut every dimension into pieces of
                                 that many indices, the last one shorter (multi_dim_split)
  merge_small_dims            -> gradapt merges from the first dimension (scalable_shampoo's
                                 merge_small_dims), the peer from the last one. The script hands
                                 the peer each tensor already reshaped to gradapt's merged shape
                                 (a row-major reshape, computed by merged_shape() below) with
                                 SingleDeviceDistributedConfig(target_parameter_dimensionality=inf),
                                 which turns the peer's own merging off
  graft adagrad/rmsprop/adam  -> grafting_config AdaGrad/RMSprop/AdamPreconditionerConfig(beta2,
                                 epsilon): g / (sqrt(a) + eps), Adam with a / (1 - beta^t); the
                                 peer grafts per block, D = D_s * |D_g| / (|D_s| + 1e-16)
  tensors the graft alone     -> a second DistributedShampoo whose preconditioner_config is the
  preconditions (1-D)            graft's config (grafting off), so the peer's own AdaGrad/RMSprop/
                                 Adam code gives their direction (the peer would otherwise give a
                                 1-D tensor a full-matrix factor)
  momentum, nesterov          -> iterate_averaging_config=ClassicMomentumConfig(momentum,
                                 dampening=0, use_nesterov); momentum 0: no config
  weight_decay                -> weight_decay with WeightDecayType.DECOUPLED: the peer adds
                                 lambda * W to the search direction before the momentum, which is
                                 gradapt's d = D + lambda * p
  dtype                       -> parameters, factor_matrix_dtype and inv_factor_matrix_dtype all
                                 float64 (reference) or all float32 (peer_float32), and torch's
                                 default dtype the same (the peer's Adam graft forms 1 - beta^t as
                                 torch.tensor(1.0) - beta**t)
Not matched, so not exercised: gradapt's relative ridge (eps * lambda_max, its default; the
peer's eigen root only takes an absolute one, and its higher-order root's lambda_max is an upper
bound rather than gradapt's power iteration), statistics_frequency > 1 (the peer updates every
step), schedules with start_preconditioning_step % precondition_frequency != 0, the peer's
gradient EMA (betas[0] > 0) and bias-corrected statistics EMA, momentum dampening, L2 (coupled)
weight decay, the peer's merging from the last dimension (the script reshapes instead), and
gradapt's inverse_exponent_override and skip_preconditioning_dim_size_gt.
"""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_refs  # noqa: E402  (the generator, the tensor record, the writer)

import distributed_shampoo as ds  # noqa: E402
from distributed_shampoo.shampoo_types import ClassicMomentumConfig  # noqa: E402
from distributed_shampoo.utils.shampoo_utils import multi_dim_split  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shampoo")
PEER = "facebookresearch/optimizers f60660661194de26d3ee78bae6d15820ff8e583d (torch-shampoo 1.0.0)"
STEPS = 32

# ---- tensors (the generator: peer_refs.values, mirrored by tests/support/counter_random.hpp) ----


class T(peer_refs.Tensor):
    def __init__(self, name, shape, pseed, gseed, plog=-1, glog=-3):
        super().__init__(name, shape, pseed, gseed, plog, glog)

    def param0(self):
        return self.flat_param0()

    def grad(self, step):  # step is 1-based
        return self.flat_grad(step)


BIAS = T("bias", [24], 11, 12)
M = T("m", [12, 10], 21, 22)
W = T("w", [24, 16], 31, 32)
BIG = T("big", [40, 20], 41, 42, glog=-2)
CONV = T("conv", [8, 4, 3, 3], 51, 52, glog=-1)

# ---- gradapt's block plan (shampoo_plan), the part the peer is handed -------------------------


def preconditioned(shape):
    """gradapt's rule: at least two dimensions larger than 1 (skip_preconditioning_dim_size_gt is
    left at 4096, larger than every tensor here)."""
    return sum(1 for d in shape if d > 1) >= 2


def merged_shape(shape, cap, merge):
    """scalable_shampoo's merge_small_dims (gradapt's): size-1 dimensions dropped, consecutive
    dimensions multiplied from the first while the product stays <= cap."""
    dims = [d for d in shape if d != 1]
    if not merge:
        return dims
    out, prod = [], 1
    for d in dims:
        if prod * d <= cap:
            prod *= d
        else:
            if prod > 1:
                out.append(prod)
            prod = d
    if prod > 1:
        out.append(prod)
    return out


# ---- running the peer --------------------------------------------------------------------------


def graft_config(c):
    g = c["graft"]
    if g == "adagrad":
        return ds.AdaGradPreconditionerConfig(epsilon=c["graft_epsilon"])
    if g == "rmsprop":
        return ds.RMSpropPreconditionerConfig(beta2=c["graft_beta2"], epsilon=c["graft_epsilon"])
    if g == "adam":
        return ds.AdamPreconditionerConfig(beta2=c["graft_beta2"], epsilon=c["graft_epsilon"])
    raise ValueError(g)


def run_peer(c, tensors, dtype, record):
    """The peer's parameters (float64 numpy, flat, per tensor) after each step in `record`.
    `c` holds the gradapt options plus peer-only overrides (keys starting with 'peer_')."""
    torch.manual_seed(0)
    # The peer makes some scalars with torch.tensor(python float) (the 1 - beta^t of its Adam
    # graft): the default dtype decides their precision.
    torch.set_default_dtype(dtype)
    shaped, diag = [], []
    for t in tensors:
        p0 = torch.from_numpy(t.param0().astype(np.float64)).to(dtype)
        if preconditioned(t.shape):
            shape = c.get("peer_shape", {}).get(t.name) or merged_shape(
                t.shape, c["max_preconditioner_dim"], c["merge_small_dims"])
            shaped.append((t, torch.nn.Parameter(p0.reshape(shape).clone())))
        else:
            diag.append((t, torch.nn.Parameter(p0.reshape(t.shape).clone())))

    momentum = None
    if c["momentum"] > 0:
        momentum = ClassicMomentumConfig(momentum=c["momentum"], dampening=0.0, use_nesterov=bool(c["nesterov"]))
    if c["root"] == "eigen":
        amortized = ds.EigenConfig()
    else:
        amortized = ds.CoupledNewtonConfig(tolerance=c["newton_tolerance"], max_iterations=c["newton_max_iterations"])
    precond = ds.RootInvShampooPreconditionerConfig(
        amortized_computation_config=amortized, factor_matrix_dtype=dtype, inv_factor_matrix_dtype=dtype,
        inverse_exponent_override=c.get("peer_exponent_override", {}))
    common = dict(lr=c["lr"], betas=(0.0, c["beta2"]), weight_decay=c["weight_decay"],
                  weight_decay_type=ds.WeightDecayType.DECOUPLED, use_bias_correction=c.get("peer_bias_correction", False),
                  iterate_averaging_config=momentum,
                  distributed_config=ds.SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf))
    graft = c.get("peer_graft", graft_config(c))
    opts = []
    if shaped:
        opts.append(ds.DistributedShampoo(
            [p for _, p in shaped], epsilon=c["epsilon"],
            max_preconditioner_dim=c.get("peer_max_preconditioner_dim", c["max_preconditioner_dim"]),
            precondition_frequency=c["precondition_frequency"],
            start_preconditioning_step=c.get("peer_start", c["start_preconditioning_step"]),
            grafting_config=graft, preconditioner_config=precond, **common))
    if diag:
        opts.append(ds.DistributedShampoo(
            [p for _, p in diag], epsilon=1e-12, max_preconditioner_dim=c["max_preconditioner_dim"],
            precondition_frequency=1, start_preconditioning_step=1, grafting_config=None,
            preconditioner_config=graft_config(c), **common))
    allp = shaped + diag
    snaps = {}
    for s in range(1, STEPS + 1):
        for t, p in allp:
            p.grad = torch.from_numpy(t.grad(s).astype(np.float64)).to(dtype).reshape(p.shape)
        for o in opts:
            o.step()
        if s in record:
            snaps[s] = {t.name: p.detach().to(torch.float64).numpy().reshape(-1).copy() for t, p in allp}
    return snaps


def peer_blocks(t, c):
    """Blocks the peer cuts tensor t into (its own multi_dim_split of the shape it is handed)."""
    if not preconditioned(t.shape):
        return 0
    shape = merged_shape(t.shape, c["max_preconditioner_dim"], c["merge_small_dims"])
    return len(multi_dim_split(torch.empty(shape), c["max_preconditioner_dim"]))


# ---- cases -------------------------------------------------------------------------------------


def base(**kw):
    c = dict(lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1, beta2=1.0, precondition_frequency=1,
             start_preconditioning_step=1, root="eigen", epsilon=1e-4, newton_tolerance=1e-6,
             newton_max_iterations=100, graft="adagrad", graft_beta2=0.0, graft_epsilon=1e-10, momentum=0.0,
             nesterov=0, weight_decay=0.0)
    c.update(kw)
    return c


def variant(c, **kw):
    d = dict(c)
    d.update(kw)
    return d


def cases():
    out = []

    # AdaGrad graft, summed statistics, eigen roots; max_preconditioner_dim 16 blocks w (16+8 rows),
    # big (3 x 2 blocks, down to 8 x 4) and merges conv [8,4,3,3] into [8,12,3] (three factors).
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=3, momentum=0.9)
    out.append(("adagrad_eigen_blocked", c, [BIAS, M, W, BIG, CONV], [
        ("epsilon 1e-3", variant(c, epsilon=1e-3)),
        ("one block per tensor", variant(c, peer_max_preconditioner_dim=1024)),
        ("exponent 1/2 for every order", variant(c, peer_exponent_override={2: 0.5, 3: 0.5})),
        ("start at step 4", variant(c, peer_start=4)),
    ]))

    # Adam graft (bias-corrected), Nesterov momentum, decoupled weight decay, roots every second
    # step from step 4; no merging: conv keeps four factors (p = 8).
    c = base(lr=2.0**-8, merge_small_dims=0, start_preconditioning_step=4, precondition_frequency=2, epsilon=1e-5,
             graft="adam", graft_beta2=0.99, graft_epsilon=1e-8, momentum=0.9, nesterov=1, weight_decay=0.01)
    out.append(("adam_eigen_nesterov_wd", c, [BIAS, W, BIG, CONV], [
        ("adam graft without bias correction",
         variant(c, peer_graft=ds.RMSpropPreconditionerConfig(beta2=0.99, epsilon=1e-8))),
        ("no weight decay", variant(c, weight_decay=0.0)),
        ("heavy-ball momentum", variant(c, nesterov=0)),
        ("roots every step", variant(c, precondition_frequency=1)),
    ]))

    # RMSprop graft, EMA statistics, coupled Newton roots, blocked as in the first case.
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=2, beta2=0.95, root="newton",
             graft="rmsprop", graft_beta2=0.9, graft_epsilon=1e-8)
    out.append(("rmsprop_ema_newton_blocked", c, [BIAS, M, W, BIG, CONV], [
        ("bias-corrected statistics", variant(c, peer_bias_correction=True)),
        ("summed statistics", variant(c, beta2=1.0)),
        ("graft beta 0.95", variant(c, peer_graft=ds.RMSpropPreconditionerConfig(beta2=0.95, epsilon=1e-8))),
        ("epsilon 1e-3", variant(c, epsilon=1e-3)),
        # The same roots to within Newton's tolerance: only the double comparison resolves them.
        ("double: eigen roots", variant(c, root="eigen")),
        ("double: newton tolerance 1e-8", variant(c, newton_tolerance=1e-8)),
    ]))

    # gradapt's default merging with max_preconditioner_dim 1024: m [12,10] and conv [8,4,3,3]
    # become one dimension each (120, 288): full-matrix AdaGrad roots (p = 2), AdaGrad graft.
    # The statistics have rank <= t < 288, so most eigenvalues are the ridge; float32 computes
    # the zero ones with an error of about 1e-7 * lambda_max * sqrt(n) (~1e-3 here), so the ridge
    # stands well above that.
    c = base(lr=2.0**-7, momentum=0.5, start_preconditioning_step=2, epsilon=0.1)
    out.append(("adagrad_fullmatrix_merged", c, [BIAS, M, CONV], [
        ("no merging", variant(c, peer_shape={"m": [12, 10], "conv": [8, 4, 3, 3]})),
        ("epsilon 1", variant(c, epsilon=1.0)),
        ("start at step 1", variant(c, peer_start=1)),
    ]))
    return out


# ---- output ------------------------------------------------------------------------------------


def max_scaled_diff(a, b, scale):
    worst = 0.0
    for s in a:
        for k in a[s]:
            worst = max(worst, float(np.max(np.abs(a[s][k] - b[s][k]))) / scale)
    return worst


def opt_line(c):
    keys = ["lr", "max_preconditioner_dim", "merge_small_dims", "beta2", "precondition_frequency",
            "start_preconditioning_step", "root", "epsilon", "newton_tolerance", "newton_max_iterations", "graft",
            "graft_beta2", "graft_epsilon", "momentum", "nesterov", "weight_decay"]
    return "opt " + " ".join("%s=%s" % (k, c[k] if isinstance(c[k], str) else repr(c[k])) for k in keys)


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    versions = peer_refs.versions(("numpy", np.__version__), ("torch", torch.__version__))
    for name, c, tensors, wrong in cases():
        record = sorted({1, c["start_preconditioning_step"], STEPS // 2, STEPS})
        ref = run_peer(c, tensors, torch.float64, record)
        f32 = run_peer(c, tensors, torch.float32, record)
        scale = max(float(np.max(np.abs(ref[STEPS][t.name] - t.param0().astype(np.float64)))) for t in tensors)
        lines = peer_refs.header("Shampoo", __file__, "peer: " + PEER, versions) + [
            "case " + name,
            "source DistributedShampoo, options mapped as in make_shampoo_refs.py",
            opt_line(c),
            "steps %d" % STEPS,
            "scale %r" % scale,
            "peer_float32 %r" % max_scaled_diff(f32, ref, scale)]
        for label, w in wrong:
            d = max_scaled_diff(run_peer(w, tensors, torch.float64, [STEPS]), {STEPS: ref[STEPS]}, scale)
            if label.startswith("double: "):
                lines.append("sensitivity_double %r %s" % (d, label[len("double: "):].replace(" ", "_")))
            else:
                lines.append("sensitivity %r %s" % (d, label.replace(" ", "_")))
        for t in tensors:
            lines.append(t.line())
            merged = merged_shape(t.shape, c["max_preconditioner_dim"], c["merge_small_dims"])
            lines.append("plan %s %d %s blocks %d" % (
                t.name, len(merged) if preconditioned(t.shape) else 0,
                " ".join(str(d) for d in merged) if preconditioned(t.shape) else "-", peer_blocks(t, c)))
        for s in record:
            for t in tensors:
                a = ref[s][t.name]
                lines.append("result %d %s count %d" % (s, t.name, a.size))
                lines.append(" ".join("%.17g" % v for v in a))
        lines.append("end")
        peer_refs.write_case(OUT, name, lines, "peer_float32", max_scaled_diff(f32, ref, scale))


if __name__ == "__main__":
    main()
