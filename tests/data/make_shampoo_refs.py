#!/usr/bin/env python3
"""Reference trajectories for gradapt's Shampoo (tests/test_shampoo_refs.cpp), from
facebookresearch/optimizers' DistributedShampoo, an implementation independent of gradapt.

Usage (not run by CI; the outputs under tests/data/shampoo/ are committed):

    python3.12 -m venv /tmp/shref && /tmp/shref/bin/pip install torch numpy
    git clone <facebookresearch/optimizers> /tmp/fbopt && git -C /tmp/fbopt checkout f60660661194de26d3ee78bae6d15820ff8e583d
    /tmp/shref/bin/pip install /tmp/fbopt        # the package torch-shampoo 1.0.0 (Python >= 3.12)
    /tmp/shref/bin/python tests/data/make_shampoo_refs.py   # writes tests/data/shampoo/*.txt
    /tmp/shref/bin/python tests/data/make_shampoo_refs.py merge_last   # only the named case(s)

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
The options that follow the peer (the cases beta1_bias_corrected .. distributed_shampoo_defaults,
whose opt lines carry their keys):
  beta1, bias_correction      -> betas=(beta1, beta2), use_bias_correction: the peer's filtered
                                 gradient m <- lerp(m, g, 1 - beta1), divided by 1 - beta1^t, is
                                 what it preconditions and grafts (beta3 = beta1, the peer's
                                 default); with beta2 < 1 the factor matrices are divided by
                                 1 - beta2^t before the root. gradapt's flag, like the peer's,
                                 governs both corrections
  precondition_1d             -> the peer's own treatment of 1-D tensors (full-matrix factors,
                                 exponent 1/2, cut by max_preconditioner_dim): the tensor goes to
                                 the Shampoo optimizer, not to the graft-alone one
  merge_from last             -> the peer's own merge_small_dims (distributed_config with
                                 target_parameter_dimensionality=1, its default): the tensor is
                                 handed in its own shape
  spectrum shift              -> EigenConfig() with its default PerturbationConfig
                                 (perturb_before_computation=True): eigh(S + eps I), shifted by
                                 -lambda_min + eps when lambda_min < eps (matrix_functions.py)
  inverse_exponents           -> inverse_exponent_override, order -> exponent 1/p, or order ->
                                 {dimension -> 1/p}; p = 0 is the peer's 0.0 (not preconditioned).
                                 Written "order:dimension:p" (dimension -1: every dimension)
  preset distributed_shampoo_defaults
                              -> DistributedShampoo(params, lr=lr) and nothing else but the
                                 float64 factor dtypes of the reference run: betas (0.9, 1.0),
                                 epsilon 1e-12, use_bias_correction, 1024, merging from the last
                                 dimension, 1-D tensors preconditioned, no grafting
  rank-deficient gradients    -> a "lowrank NAME R" record: G_t = sum_r c_t[r] u_r v_r^T with u_r,
                                 v_r fixed vectors of 8-bit values (trunc(x * 2^7) / 2^7 of the
                                 generator's values of seeds gseed + 100 + r, gseed + 200 + r,
                                 scale 2^0) and c_t = the generator's R values of seed
                                 gseed + 1000 t: every product and sum exact in float64, the
                                 float32 gradient its rounding (see LowRank below)
Not matched, so not exercised: gradapt's relative ridge (eps * lambda_max, its default; the
peer's eigen root only takes an absolute one, and its higher-order root's lambda_max is an upper
bound rather than gradapt's power iteration), statistics_frequency > 1 (the peer updates every
step), schedules with start_preconditioning_step % precondition_frequency != 0, the peer's
beta3 != beta1, momentum dampening, L2 (coupled) weight decay, and gradapt's
skip_preconditioning_dim_size_gt.
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
from distributed_shampoo.utils.shampoo_utils import merge_small_dims, multi_dim_split  # noqa: E402

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


class LowRank(T):
    """A tensor whose gradients have rank R, in fixed column and row spaces (see the docstring)."""

    def __init__(self, name, shape, pseed, gseed, rank, plog=-1, glog=-3):
        super().__init__(name, shape, pseed, gseed, plog, glog)
        self.rank = rank
        m, n = shape
        q = lambda seed, k: np.trunc(peer_refs.values(seed, k, 0).astype(np.float64) * 128.0) / 128.0
        self.u = [q(gseed + 100 + r, m) for r in range(rank)]
        self.v = [q(gseed + 200 + r, n) for r in range(rank)]

    def grad(self, step):
        c = peer_refs.values(self.gseed + 1000 * step, self.rank, self.glog).astype(np.float64)
        g = np.zeros(self.shape, dtype=np.float64)
        for r in range(self.rank):
            g += c[r] * np.outer(self.u[r], self.v[r])
        return g.reshape(-1)

    def line(self):
        return super().line() + "\nlowrank %s %d" % (self.name, self.rank)


BIAS = T("bias", [24], 11, 12)
M = T("m", [12, 10], 21, 22)
W = T("w", [24, 16], 31, 32)
BIG = T("big", [40, 20], 41, 42, glog=-2)
CONV = T("conv", [8, 4, 3, 3], 51, 52, glog=-1)
R3 = T("r3", [6, 5, 4], 61, 62, glog=-2)
WIDE = T("wide", [40, 30], 71, 72)
BIG2 = T("big2", [48, 40], 91, 92)
LOW = LowRank("low", [64, 48], 81, 82, 2)

# ---- gradapt's block plan (shampoo_plan), the part the peer is handed -------------------------


def preconditioned(shape, c=None):
    """gradapt's rule: at least two dimensions larger than 1, or any tensor with precondition_1d
    (skip_preconditioning_dim_size_gt is left at 4096, larger than every tensor here)."""
    if c is not None and c.get("precondition_1d", 0):
        return True
    return sum(1 for d in shape if d > 1) >= 2


def merged_shape(shape, cap, merge, last=False):
    """gradapt's merging: size-1 dimensions dropped, consecutive dimensions multiplied from the
    first (scalable_shampoo's merge_small_dims) or from the last (the peer's) while the product
    stays <= cap."""
    dims = [d for d in shape if d != 1] or [1]
    if not merge:
        return dims
    if last:
        dims = dims[::-1]
    out, prod = [], 1
    for d in dims:
        if prod * d <= cap:
            prod *= d
        else:
            if prod > 1:
                out.append(prod)
            prod = d
    if prod > 1 or not out:
        out.append(prod)
    return out[::-1] if last else out


def plan_shape(t, c):
    return merged_shape(t.shape, c["max_preconditioner_dim"], c["merge_small_dims"], c["merge_from"] == "last")


def peer_exponents(c):
    """gradapt's inverse_exponents ("order:dimension:p,...") as the peer's override map."""
    if c["exponents"] == "-":
        return {}
    out = {}
    for e in c["exponents"].split(","):
        order, dim, p = (int(x) for x in e.split(":"))
        x = 0.0 if p == 0 else 1.0 / p
        if dim < 0:
            out[order] = x
        else:
            out.setdefault(order, {})[dim] = x
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
    peer_merges = c["merge_from"] == "last" and c["merge_small_dims"] and not c.get("peer_merge_first")
    for t in tensors:
        p0 = torch.from_numpy(t.param0().astype(np.float64)).to(dtype)
        if preconditioned(t.shape, c) and not (c.get("peer_diag_1d") and len(t.shape) == 1):
            if peer_merges:
                shape = t.shape  # the peer merges (from the last dimension) itself
            else:
                shape = c.get("peer_shape", {}).get(t.name) or merged_shape(
                    t.shape, c["max_preconditioner_dim"], c["merge_small_dims"])
            shaped.append((t, torch.nn.Parameter(p0.reshape(shape).clone())))
        else:
            diag.append((t, torch.nn.Parameter(p0.reshape(t.shape).clone())))

    if c["preset"] == "distributed_shampoo_defaults":
        # The peer's defaults; only lr and the reference's float64 factor dtypes are set.
        assert not diag
        precond = ds.RootInvShampooPreconditionerConfig(factor_matrix_dtype=dtype, inv_factor_matrix_dtype=dtype)
        extra = c.get("peer_preset_overrides", {})
        opt = ds.DistributedShampoo([p for _, p in shaped], lr=c["lr"], preconditioner_config=precond, **extra)
        return step_peer(c, [opt], shaped, dtype, record)

    momentum = None
    if c["momentum"] > 0:
        momentum = ClassicMomentumConfig(momentum=c["momentum"], dampening=0.0, use_nesterov=bool(c["nesterov"]))
    if c["root"] == "eigen":
        amortized = ds.EigenConfig()
    else:
        amortized = ds.CoupledNewtonConfig(tolerance=c["newton_tolerance"], max_iterations=c["newton_max_iterations"])
    precond = ds.RootInvShampooPreconditionerConfig(
        amortized_computation_config=amortized, factor_matrix_dtype=dtype, inv_factor_matrix_dtype=dtype,
        inverse_exponent_override=c.get("peer_exponent_override", peer_exponents(c)))
    if "peer_momentum" in c:  # (momentum, dampening): a wrong variant's momentum after the preconditioner
        momentum = ClassicMomentumConfig(momentum=c["peer_momentum"][0], dampening=c["peer_momentum"][1],
                                         use_nesterov=False)
    common = dict(lr=c["lr"], betas=(c.get("peer_beta1", c["beta1"]), c["beta2"]), weight_decay=c["weight_decay"],
                  weight_decay_type=ds.WeightDecayType.DECOUPLED,
                  use_bias_correction=c.get("peer_bias_correction", bool(c["bias_correction"])),
                  iterate_averaging_config=momentum,
                  distributed_config=ds.SingleDeviceDistributedConfig(
                      target_parameter_dimensionality=1 if peer_merges else math.inf))
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
    return step_peer(c, opts, shaped + diag, dtype, record)


def step_peer(c, opts, allp, dtype, record):
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
    """Blocks the peer cuts tensor t into (its own multi_dim_split of the shape it is handed; with
    the peer merging, its own merge_small_dims first, checked against gradapt's plan)."""
    if not preconditioned(t.shape, c):
        return 0
    shape = plan_shape(t, c)
    if c["merge_from"] == "last" and c["merge_small_dims"]:
        theirs = list(merge_small_dims(tuple(t.shape), c["max_preconditioner_dim"], 1))
        assert theirs == shape, (t.name, theirs, shape)
    return len(multi_dim_split(torch.empty(shape), c["max_preconditioner_dim"]))


# ---- cases -------------------------------------------------------------------------------------


def base(**kw):
    c = dict(lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1, beta2=1.0, precondition_frequency=1,
             start_preconditioning_step=1, root="eigen", epsilon=1e-4, newton_tolerance=1e-6,
             newton_max_iterations=100, graft="adagrad", graft_beta2=0.0, graft_epsilon=1e-10, momentum=0.0,
             nesterov=0, weight_decay=0.0, beta1=0.0, bias_correction=0, precondition_1d=0, merge_from="first",
             spectrum="clamp", exponents="-", preset="-")
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

    # ---- the options that follow the peer (their opt lines carry the keys below) ----

    # beta1: the bias-corrected first moment is preconditioned and grafted (summed statistics,
    # so use_bias_correction only corrects the first moment); the graft-alone bias divides it too.
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=2, beta1=0.9, bias_correction=1,
             new=True)
    out.append(("beta1_bias_corrected", c, [BIAS, M, W, CONV], [
        ("beta1 after the preconditioner (momentum 0.9, dampening 0.1)",
         variant(c, peer_beta1=0.0, peer_momentum=(0.9, 0.1))),
        ("first moment not bias-corrected", variant(c, peer_bias_correction=False)),
        ("beta1 0.8", variant(c, peer_beta1=0.8)),
    ]))

    # use_bias_correction of an EMA of the statistics (beta2 < 1), eigen roots, RMSprop graft.
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=2, beta2=0.9, bias_correction=1,
             graft="rmsprop", graft_beta2=0.9, graft_epsilon=1e-8, epsilon=1e-5, new=True)
    out.append(("ema_bias_corrected_statistics", c, [BIAS, M, W, BIG], [
        ("statistics not bias-corrected", variant(c, peer_bias_correction=False)),
        ("beta2 0.95", variant(c, beta2=0.95)),
    ]))

    # 1-D tensors preconditioned: bias [24] cut into full-matrix blocks of 16 and 8 (p = 2). The
    # statistics of a 1-D block have rank <= t: the ridge stands above float32's rounding.
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=2, epsilon=1e-2,
             precondition_1d=1, new=True)
    out.append(("precondition_1d_blocked", c, [BIAS, M, W], [
        ("1-D tensors by the graft alone", variant(c, peer_diag_1d=True)),
        ("one block per tensor", variant(c, peer_max_preconditioner_dim=1024)),
    ]))

    # A rank-3 tensor [6, 5, 4] with three factors (p = 6), not merged, beside a matrix.
    c = base(lr=2.0**-7, merge_small_dims=0, start_preconditioning_step=2, epsilon=1e-5, momentum=0.5,
             new=True)
    out.append(("rank3_eigen", c, [R3, W], [
        ("exponent 1/4 for order 3", variant(c, peer_exponent_override={3: 0.25})),
        ("epsilon 1e-3", variant(c, epsilon=1e-3)),
    ]))

    # Rank-deficient factors: gradients of rank 2 in fixed subspaces of a [64, 48] parameter, so
    # both factors keep rank 2 for good; eigen roots with the peer's shifted spectrum. float32
    # computes the 62 (46) zero eigenvalues as +-1e-7 lambda_max: below the ridge of 1e-4
    # lambda_max they leave, the shift and the clamp differ by that rounding.
    c = base(lr=2.0**-7, start_preconditioning_step=1, epsilon=1e-4, spectrum="shift", new=True)
    out.append(("rank_deficient_shift", c, [LOW, W], [
        # (epsilon 1e-3 lands only 1.8e-5 away: the gradients lie in the factors' ranges, where
        # lambda >> epsilon, so the ridge acts through the graft's normalisation alone)
        ("epsilon 1", variant(c, epsilon=1.0)),
        ("exponent 1/2", variant(c, peer_exponent_override={2: 0.5})),
    ]))

    # Merging from the last dimension (the peer merges itself): conv [8, 4, 3, 3] -> [8, 4, 9]
    # (from the first: [8, 12, 3]), r3 [6, 5, 4] -> [6, 5, 4] unchanged at 16, m [12, 10] as is.
    c = base(lr=2.0**-7, max_preconditioner_dim=16, start_preconditioning_step=2, merge_from="last",
             epsilon=1e-4, new=True)
    out.append(("merge_last", c, [BIAS, M, CONV, R3], [
        ("merged from the first dimension", variant(c, peer_merge_first=True)),
    ]))

    # inverse_exponent_override: order 2 -> 1/2 on both factors; order 3 -> dimension 0 not
    # preconditioned, dimension 1 at 1/4, dimension 2 the default 1/6.
    c = base(lr=2.0**-7, merge_small_dims=0, start_preconditioning_step=2, epsilon=1e-4,
             exponents="2:-1:2,3:0:0,3:1:4", new=True)
    out.append(("exponent_override_map", c, [BIAS, W, R3], [
        ("default exponents", variant(c, exponents="-")),
        ("order 3 dimension 0 preconditioned (1/6)", variant(c, exponents="2:-1:2,3:1:4")),
    ]))

    # The peer's defaults: DistributedShampoo(params, lr=2^-7) (lr a power of two, exact in
    # float32; everything else the constructor's defaults) and gradapt's
    # distributed_shampoo_defaults() with the same lr. wide [40, 30] and big2 [48, 40] (more than
    # 1024 elements) keep two factors each, rank-deficient (rank 30 of 40, 40 of 48) at step 1
    # only. With epsilon 1e-12 float32 is noise wherever a factor stays rank-deficient: the
    # peer's own float32 run lands 2e-2 (bias [24]) to 3e-1 (conv, merged to [288]) from its
    # float64 run when 1-D or merged tensors are added, too far for a float comparison, so this
    # case keeps to matrices (precondition_1d_blocked covers 1-D blocks).
    c = base(lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1, merge_from="last", beta1=0.9,
             bias_correction=1, precondition_1d=1, epsilon=1e-12, spectrum="shift", graft="none",
             preset="distributed_shampoo_defaults", new=True)
    out.append(("distributed_shampoo_defaults", c, [WIDE, BIG2], [
        ("no first moment (betas (0, 1))", variant(c, peer_preset_overrides={"betas": (0.0, 1.0)})),
        ("first moment not bias-corrected", variant(c, peer_preset_overrides={"use_bias_correction": False})),
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
    if c.get("new", False):  # the cases of the options that follow the peer
        keys += ["beta1", "bias_correction", "precondition_1d", "merge_from", "spectrum", "exponents", "preset"]
    return "opt " + " ".join("%s=%s" % (k, c[k] if isinstance(c[k], str) else repr(c[k])) for k in keys)


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    versions = peer_refs.versions(("numpy", np.__version__), ("torch", torch.__version__))
    only = set(sys.argv[1:])
    for name, c, tensors, wrong in cases():
        if only and name not in only:
            continue
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
            merged = plan_shape(t, c)
            pre = preconditioned(t.shape, c)
            lines.append("plan %s %d %s blocks %d" % (
                t.name, len(merged) if pre else 0, " ".join(str(d) for d in merged) if pre else "-",
                peer_blocks(t, c)))
        for s in record:
            for t in tensors:
                a = ref[s][t.name]
                lines.append("result %d %s count %d" % (s, t.name, a.size))
                lines.append(" ".join("%.17g" % v for v in a))
        lines.append("end")
        peer_refs.write_case(OUT, name, lines, "peer_float32", max_scaled_diff(f32, ref, scale))


if __name__ == "__main__":
    main()
