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
                 eigen root in place of coupled Newton, whose result is within Newton's tolerance);
  peer_float32_spread VALUE LABEL
                 (the cases in SPREAD_CASES only: soap_defaults) the largest distance, measured as
                 peer_float32, of the peer's float32 runs from its float64 run over the plain run
                 (LABEL plain) and runs that change float32's rounding order but not the math, and
                 the label of the run that gave it. The variants (SPREAD_VARIANTS):
                   threads_2, threads_4        the float32 run with 2 or 4 intra-op threads (the
                                               plain run uses 1)
                   factor_summed,              the factor update A A^T (A: the gradient with
                   factor_sequential,          dimension k first, flattened) as a vectorised sum of
                   factor_sequential_reversed, the elementwise products, as rank-1 updates column
                   factor_float64_rounded      by column in ascending or descending order, or in
                                               float64 rounded once, instead of the peer's tensordot
                   rotation_reversed,          the rotations into and out of the eigenbasis
                   rotation_float64_rounded    contracted last dimension first, or in float64
                                               rounded once
                   qr_QtAQ_right_first,        the QR refresh with B = Q^T (A Q) instead of
                   qr_float64_rounded          (Q^T A) Q, or each QR factorisation in float64
                                               rounded to float32
                   mkl_cbwr_compatible         the unpatched peer in a fresh process of this script
                                               (--float32-distance CASE) with MKL_CBWR=COMPATIBLE
                                               (MKL's conditional-reproducibility code path; no
                                               effect where torch's BLAS is not MKL)
                 The patches replace the peer's code for one run (peer_patch). In soap_defaults
                 (epsilon 1e-12, summed corrected eigenvalues) the whole float32 distance is made
                 at step 2: the basis has changed since step 1, a few corrected eigenvalues are
                 tiny sums of squares of cancelling rotated entries, and the quotient
                 m' / (sqrt(V) + eps) there reaches 51 (elsewhere at most 3.5) with the relative
                 rounding error of those entries, so the distance follows the summation order and
                 the float32 comparison is bounded by the spread rather than by one order.

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
The Shampoo family (the cases spectral_descent_* and soap_*, whose opt lines carry the keys
above plus preconditioner and the keys below; same peer commit; its
preconditioner/matrix_functions.py (newton_schulz, matrix_eigendecomposition) and
preconditioner/shampoo_preconditioner_list.py (EigenvalueCorrectedShampooPreconditionerList) hold
the math):
  preconditioner              -> preconditioner_config: shampoo = RootInvShampooPreconditionerConfig
                                 (every case above), spectral_descent =
                                 SpectralDescentPreconditionerConfig, eigenvalue_corrected =
                                 EigenvalueCorrectedShampooPreconditionerConfig
  graft_preconditioned        -> whether the preconditioned blocks are grafted (grafting_config on
                                 their optimizer); 0: graft/graft_beta2/graft_epsilon only name the
                                 method of the tensors the preconditioner does not take (the
                                 README's Muon recipe: a second param group with AdamW)
 spectral_descent (precondition_frequency, start_preconditioning_step, beta2, epsilon and the
 root keys have no effect):
  tensors                     -> merged as the peer's merge_small_dims(shape, max_preconditioner_dim,
                                 target_parameter_dimensionality=2), which the peer imposes: size-1
                                 dimensions dropped, then from the last dimension while more than
                                 two remain and the product stays <= max_preconditioner_dim
                                 ([6, 5, 4] -> [6, 20], [8, 4, 3, 3] -> [8, 36]); then cut into
                                 blocks of max_preconditioner_dim (multi_dim_split). 2-D results
                                 are orthogonalised block by block, 1-D ones go to the graft alone
                                 (the peer raises for them, so the script hands them to a second
                                 DistributedShampoo as above), and a tensor left with more than two
                                 dimensions is an error in the peer (no case has one). The plan line
                                 gives that 2-D shape
  ns_steps, ns_a, ns_b, ns_c  -> NewtonSchulzOrthogonalizationConfig(num_iterations, coefficients):
                                 X = M / max(|M|_F, ns_epsilon), transposed when rows < cols, then
                                 ns_steps times B = X^T X, X <- ns_a X + X (ns_b B + ns_c B^2)
                                 (the peer's defaults 5, (3.4445, -4.7750, 2.0315))
  ns_epsilon                  -> the peer's fixed clamp of the Frobenius norm, 1e-8 (not settable)
  ns_scale none | aspect      -> scale_by_dims_fn: none = 1 (the peer's default), aspect =
                                 sqrt(max(1, rows / cols)) (the README's Muon example)
  beta1, bias_correction      -> betas[0], use_bias_correction as above: the first moment is what is
                                 orthogonalised (its bias correction cancels in the
                                 orthogonalisation, and still divides the graft-alone tensors' m)
  momentum, nesterov,         -> as above, applied after the orthogonalisation; weight decay is
  weight_decay                   added to the orthogonalised direction (D + lambda W)
  preset spectral_descent_defaults
                              -> DistributedShampoo(params, lr=lr,
                                 preconditioner_config=DefaultSpectralDescentPreconditionerConfig)
                                 and a fresh SingleDeviceDistributedConfig() (the peer sets the one
                                 it is handed to target 2, the module's default object included)
 eigenvalue_corrected (SOAP; grafting none in every case, the peer's default):
  beta2, bias_correction,     -> betas[1], use_bias_correction, epsilon: the factor matrices as in
  epsilon                        Shampoo (beta2 < 1: EMA with weight 1 - beta2 and, with bias
                                 correction, divided by 1 - beta2^t before the eigenbasis), the
                                 eigenbasis of S / (1 - beta2^t) + epsilon I
  corrected_beta2             -> the corrected eigenvalues' beta: the peer uses betas[1] for both
                                 (always equal to beta2 here; a wrong variant patches it)
  corrected_epsilon           -> the peer's epsilon again (always equal to epsilon here): the
                                 direction is Q (Q^T m Q / ((V / (1 - beta2^t))^(1/p) + eps)) Q^T
  corrected_exponent p        -> inverse_exponent_override {order: 1/p} of
                                 EigenvalueCorrectedShampooPreconditionerConfig (default 1/2: p = 2)
  eigenbasis eigh | qr        -> amortized_computation_config EighEigendecompositionConfig()
                                 (eigenvectors in ascending eigenvalue order) or
                                 QREigendecompositionConfig(max_iterations=qr_iterations,
                                 tolerance=qr_tolerance): from the previous basis Q (the identity
                                 the first time) B = Q^T (S + eps I) Q, then while the iteration
                                 count < qr_iterations and |offdiag B|_F > qr_tolerance |B|_F:
                                 (q, r) = qr(B), B <- r q, Q <- Q q; columns sorted by diag(B),
                                 ascending (stable); PerturbationConfig(perturb_before_computation)
                                 as the peer's default, every factor dtype the run's
  precondition_frequency,     -> the eigenbasis is recomputed at t == s and at t > s with
  start_preconditioning_step     t % f == 0 (as above); before s the basis is the identity (with
                                 no graft the peer preconditions from step 1: Adam in the identity
                                 basis), the corrected eigenvalues are updated every step and never
                                 re-rotated or permuted when the basis changes
  precondition_1d 1           -> the peer gives 1-D tensors a full-matrix factor (b6 [6])
  merge_small_dims 0          -> target_parameter_dimensionality=inf, the tensor's own shape
  preset soap_defaults        -> DistributedShampoo(params, lr=lr, preconditioner_config=
                                 DefaultSOAPConfig with the factor, eigenvector and corrected-
                                 eigenvalue dtypes of the run) and a fresh
                                 SingleDeviceDistributedConfig(): betas (0.9, 1.0), epsilon 1e-12,
                                 bias correction, QR (1 iteration, tolerance 0) every step from
                                 step 1, merging from the last dimension, no grafting
 Wrong variants that the peer has no option for patch its code for their run only (peer_patch:
 the eps inside the root, the corrected eigenvalues with another beta or not bias-corrected, the
 eigenvectors in descending order, QR restarted from the identity or not sorted, Newton-Schulz
 normalised by the spectral norm). Measured and left out as not wrong: Newton-Schulz without the
 transposition (2.6e-15 from the reference), the ridge before eigh (5e-15), the first moment's
 bias correction on the orthogonalised blocks (2.6e-15).
Not matched, so not exercised: gradapt's relative ridge (eps * lambda_max, its default; the
peer's eigen root only takes an absolute one, and its higher-order root's lambda_max is an upper
bound rather than gradapt's power iteration), statistics_frequency > 1 (the peer updates every
step), schedules with start_preconditioning_step % precondition_frequency != 0, the peer's
beta3 != beta1, momentum dampening, L2 (coupled) weight decay, and gradapt's
skip_preconditioning_dim_size_gt.
"""

import contextlib
import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_refs  # noqa: E402  (the generator, the tensor record, the writer)

import distributed_shampoo as ds  # noqa: E402
import distributed_shampoo.preconditioner.shampoo_preconditioner_list as spl  # noqa: E402
import distributed_shampoo.preconditioner.spectral_descent_preconditioner_list as sdl  # noqa: E402
from distributed_shampoo.shampoo_types import ClassicMomentumConfig  # noqa: E402
from distributed_shampoo.utils.shampoo_utils import compress_list, merge_small_dims, multi_dim_split  # noqa: E402

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
    if c.get("family"):
        return run_family(c, tensors, dtype, record)
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
    return out + family_cases()


# ---- the Shampoo family: spectral descent (Muon) and eigenvalue-corrected Shampoo (SOAP) ----
# (the cases spectral_descent_* and soap_*, after every Shampoo case; see the docstring's last table)

WT = T("wt", [16, 40], 101, 102)  # rows < cols
SQ = T("sq", [36, 36], 111, 112)  # square with more than 1024 elements: two full-rank factors from step 1
B6 = T("b6", [6], 131, 132)  # 1-D, its 6 x 6 factor full-rank from step 6 on


def _scale_none(d_in, d_out):  # (named functions: the peer warns about lambdas)
    return 1.0


def _scale_aspect(d_in, d_out):  # the README's Muon example: sqrt(max(1, d_out / d_in)) = sqrt(max(1, rows / cols))
    return max(1, d_out / d_in) ** 0.5


NS_SCALES = {"none": _scale_none, "aspect": _scale_aspect}


def family_shape(t, c):
    """The shape the peer cuts tensor t's blocks from: spectral descent merges (its
    merge_small_dims with target_parameter_dimensionality 2, which it imposes) and takes 2-D
    results only (the graft alone takes the rest: None); eigenvalue-corrected Shampoo keeps the
    shape (merge_small_dims 0: target inf, size-1 dimensions dropped) or merges from the last
    dimension down to one (target 1, the peer's default)."""
    if c["preconditioner"] == "spectral_descent":
        shape = list(merge_small_dims(tuple(t.shape), c["max_preconditioner_dim"], 2))
        if len(shape) > 2:
            raise ValueError("%s: %s does not merge to 2-D (the peer raises)" % (t.name, shape))
        return shape if len(shape) == 2 else None
    if not c["merge_small_dims"]:
        return [d for d in t.shape if d != 1] or [1]
    assert c["merge_from"] == "last"
    return list(merge_small_dims(tuple(t.shape), c["max_preconditioner_dim"], 1))


def family_plan(t, c):
    shape = family_shape(t, c)
    if shape is None:
        return None, 0
    return shape, len(multi_dim_split(torch.empty(shape), c["max_preconditioner_dim"]))


def family_config(c, dtype):
    if c["preconditioner"] == "spectral_descent":
        assert c["ns_epsilon"] == 1e-8  # the peer's clamp of the Frobenius norm (matrix_functions.py)
        if c.get("peer_svd"):
            orth = ds.SVDOrthogonalizationConfig(scale_by_dims_fn=NS_SCALES[c["ns_scale"]])
        else:
            orth = ds.NewtonSchulzOrthogonalizationConfig(
                num_iterations=c["ns_steps"], coefficients=(c["ns_a"], c["ns_b"], c["ns_c"]),
                scale_by_dims_fn=NS_SCALES[c["ns_scale"]])
        return ds.SpectralDescentPreconditionerConfig(orthogonalization_config=orth)
    assert c["preconditioner"] == "eigenvalue_corrected"
    assert c["corrected_beta2"] == c["beta2"] and c["corrected_epsilon"] == c["epsilon"]  # tied in the peer
    perturbation = ds.PerturbationConfig(perturb_before_computation=not c.get("peer_no_ridge", False))
    basis = c.get("peer_eigenbasis", c["eigenbasis"])
    if basis == "eigh":
        amortized = ds.EighEigendecompositionConfig(rank_deficient_stability_config=perturbation)
    else:
        amortized = ds.QREigendecompositionConfig(rank_deficient_stability_config=perturbation,
                                                  max_iterations=c.get("peer_qr_iterations", c["qr_iterations"]),
                                                  tolerance=c["qr_tolerance"])
    exponent = 1.0 / c.get("peer_corrected_exponent", c["corrected_exponent"])
    return ds.EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=amortized, factor_matrix_dtype=dtype,
        factor_matrix_eigenvectors_dtype=dtype, corrected_eigenvalues_dtype=dtype,
        inverse_exponent_override={} if exponent == 0.5 else {k: exponent for k in (1, 2, 3, 4)})


def run_family(c, tensors, dtype, record):
    """run_peer for the family's cases (the peer's code patched by the wrong variants' peer_patch
    entries, (object, attribute, replacement), for the run only)."""
    with contextlib.ExitStack() as stack:
        for obj, name, value in c.get("peer_patch", []):
            stack.enter_context(_patched(obj, name, value))
        return _run_family(c, tensors, dtype, record)


_ABSENT = object()


@contextlib.contextmanager
def _patched(obj, name, value):
    # vars(), not getattr(): a staticmethod (_precondition_grad) must go back as the staticmethod,
    # and an inherited attribute (_compute_outer_product_list) must not stay on the subclass.
    old = vars(obj).get(name, _ABSENT)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is _ABSENT:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def _run_family(c, tensors, dtype, record):
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    spectral = c["preconditioner"] == "spectral_descent"
    shaped, diag = [], []
    for t in tensors:
        p0 = torch.from_numpy(t.param0().astype(np.float64)).to(dtype)
        shape = family_shape(t, c)
        if shape is None:
            diag.append((t, torch.nn.Parameter(p0.reshape(t.shape).clone())))
        elif spectral or c["merge_small_dims"]:
            shaped.append((t, torch.nn.Parameter(p0.reshape(t.shape).clone())))  # the peer merges itself
        else:
            shaped.append((t, torch.nn.Parameter(p0.reshape(shape).clone())))
    precond = family_config(c, dtype)
    # A fresh distributed config every run: spectral descent sets the one it is handed to
    # target_parameter_dimensionality 2 (distributed_shampoo.py), the module's default included.
    target = 2 if spectral else (1 if c["merge_small_dims"] else math.inf)
    if c["preset"] != "-":
        # The peer's defaults; only lr (and for SOAP the reference's float64 dtypes) are set.
        assert not diag
        if c["preset"] == "soap_defaults":
            default = ds.DefaultEigenvalueCorrectedShampooConfig if c.get("peer_eigenbasis") == "eigh" else \
                ds.DefaultSOAPConfig
            precond = dataclasses.replace(default, factor_matrix_dtype=dtype,
                                          factor_matrix_eigenvectors_dtype=dtype, corrected_eigenvalues_dtype=dtype)
        else:
            assert c["preset"] == "spectral_descent_defaults"
            precond = c.get("peer_preconditioner", ds.DefaultSpectralDescentPreconditionerConfig)
        extra = c.get("peer_preset_overrides", {})
        opt = ds.DistributedShampoo([p for _, p in shaped], lr=c["lr"], preconditioner_config=precond,
                                    distributed_config=ds.SingleDeviceDistributedConfig(), **extra)
        return step_peer(c, [opt], shaped, dtype, record)

    momentum = None
    if c["momentum"] > 0:
        momentum = ClassicMomentumConfig(momentum=c["momentum"], dampening=0.0, use_nesterov=bool(c["nesterov"]))
    if "peer_momentum" in c:
        momentum = ClassicMomentumConfig(momentum=c["peer_momentum"][0], dampening=c["peer_momentum"][1],
                                         use_nesterov=False)
    common = dict(lr=c["lr"], betas=(c.get("peer_beta1", c["beta1"]), c["beta2"]), beta3=c.get("peer_beta3", -1.0),
                  weight_decay=c["weight_decay"], weight_decay_type=ds.WeightDecayType.DECOUPLED,
                  use_bias_correction=c.get("peer_bias_correction", bool(c["bias_correction"])),
                  iterate_averaging_config=momentum)
    graft = None
    if c["graft"] != "none" and c["graft_preconditioned"]:
        graft = graft_config(c)
    graft = c.get("peer_graft", graft)
    opts = []
    if shaped:
        opts.append(ds.DistributedShampoo(
            [p for _, p in shaped], epsilon=c["epsilon"],
            max_preconditioner_dim=c.get("peer_max_preconditioner_dim", c["max_preconditioner_dim"]),
            precondition_frequency=c.get("peer_precondition_frequency", c["precondition_frequency"]),
            start_preconditioning_step=c["start_preconditioning_step"], grafting_config=graft,
            preconditioner_config=precond,
            distributed_config=ds.SingleDeviceDistributedConfig(target_parameter_dimensionality=target), **common))
    if diag:
        opts.append(ds.DistributedShampoo(
            [p for _, p in diag], epsilon=1e-12, max_preconditioner_dim=c["max_preconditioner_dim"],
            precondition_frequency=1, start_preconditioning_step=1, grafting_config=None,
            preconditioner_config=graft_config(c),
            distributed_config=ds.SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf), **common))
    return step_peer(c, opts, shaped + diag, dtype, record)


# -- the wrong variants' replacements of the peer's code (each a copy with one thing changed) --

def _newton_schulz(A, cfg, norm_ord="fro", transpose_wide=True):
    """matrix_functions.py's newton_schulz and scaling, with the normalising norm and the
    transposition as parameters."""
    X = A / torch.clamp(torch.linalg.matrix_norm(A, ord=norm_ord), min=1e-8)
    a, b, c = cfg.coefficients
    transpose = transpose_wide and A.shape[0] < A.shape[1]
    if transpose:
        X = X.T
    for _ in range(cfg.num_iterations):
        B = X.T @ X
        B = torch.addmm(B, B, B, beta=b, alpha=c)
        X = torch.addmm(X, X, B, beta=a, alpha=1.0)
    if transpose:
        X = X.T
    return X.mul_(cfg.scale_by_dims_fn(A.shape[1], A.shape[0]))


def _orth_spectral_norm(A, orthogonalization_config):
    return _newton_schulz(A, orthogonalization_config, norm_ord=2)


def _orth_no_transpose(A, orthogonalization_config):
    return _newton_schulz(A, orthogonalization_config, transpose_wide=False)


_peer_eig = spl.matrix_eigendecomposition


def _eig_descending(A, epsilon=0.0, eigendecomposition_config=None, eigenvectors_estimate=None):
    L, Q = _peer_eig(A=A, epsilon=epsilon, eigendecomposition_config=eigendecomposition_config,
                     eigenvectors_estimate=eigenvectors_estimate)
    return L.flip(0), Q.flip(1)


def _eig_cold_qr(A, epsilon=0.0, eigendecomposition_config=None, eigenvectors_estimate=None):
    eye = torch.eye(A.shape[0], dtype=A.dtype)
    return _peer_eig(A=A, epsilon=epsilon, eigendecomposition_config=eigendecomposition_config,
                     eigenvectors_estimate=eye)


def _eig_unsorted_qr(A, epsilon=0.0, eigendecomposition_config=None, eigenvectors_estimate=None):
    """matrix_functions.py's qr_algorithm (tolerance 0: every iteration runs) without its final
    ascending sort."""
    Q = eigenvectors_estimate
    B = Q.T @ (A + epsilon * torch.eye(A.shape[0], dtype=A.dtype)) @ Q
    for _ in range(eigendecomposition_config.max_iterations):
        q, r = torch.linalg.qr(B)
        B = r @ q
        Q = Q @ q
    return B.diag(), Q


def _ec_precondition(eps_inside=False, bias_correct=True):
    """EigenvalueCorrectedShampooPreconditionerList._compute_preconditioned_gradient with eps
    inside the root, or the corrected eigenvalues not bias-corrected."""

    def precondition(self, grad, preconditioned_dims_selector, kronecker_factors):
        g = self._precondition_grad(grad=grad.clone(), preconditioned_dims_selector=preconditioned_dims_selector,
                                    preconditioner_list=kronecker_factors.factor_matrices_eigenvectors)
        v = kronecker_factors.corrected_eigenvalues
        if bias_correct:
            v = v.div(self._bias_correction2)
        if eps_inside:
            d = v.add(self._epsilon).pow(1 / kronecker_factors.roots[0])
        else:
            d = v.pow(1 / kronecker_factors.roots[0]).add(self._epsilon)
        g.div_(d)
        return self._precondition_grad(grad=g, preconditioned_dims_selector=preconditioned_dims_selector,
                                       preconditioner_list=kronecker_factors.factor_matrices_eigenvectors,
                                       dims=([0], [1]))

    return precondition


def _ec_update(corrected_beta2):
    """EigenvalueCorrectedShampooPreconditionerList.update_preconditioners with another beta2 (and
    weight 1 - beta2) for the corrected eigenvalues than for the factor matrices."""

    def update(self, masked_grad_list, step, perform_amortized_computation):
        spl.BaseShampooPreconditionerList.update_preconditioners(
            self, masked_grad_list=masked_grad_list, step=step,
            perform_amortized_computation=perform_amortized_computation)
        for grad, selector, kf in zip(masked_grad_list, self._masked_preconditioned_dims_selector_list,
                                      self._masked_kronecker_factors_unwrapped, strict=True):
            g = self._precondition_grad(grad=grad, preconditioned_dims_selector=selector,
                                        preconditioner_list=kf.factor_matrices_eigenvectors)
            kf.corrected_eigenvalues.mul_(corrected_beta2).addcmul_(g, g, value=1 - corrected_beta2)

    return update


EC_LIST = spl.EigenvalueCorrectedShampooPreconditionerList


def family(**kw):
    """base() plus the family's keys: the peer's NewtonSchulzOrthogonalizationConfig defaults and
    EigenvalueCorrectedShampooPreconditionerConfig's (eigh, QR 1 iteration, tolerance 0, 1/2)."""
    c = base(new=True, family=True, preconditioner="shampoo", graft_preconditioned=1, ns_steps=5, ns_a=3.4445,
             ns_b=-4.775, ns_c=2.0315, ns_epsilon=1e-8, ns_scale="none", eigenbasis="eigh", qr_iterations=1,
             qr_tolerance=0.0, corrected_exponent=2)
    c.update(kw)
    c.setdefault("corrected_beta2", c["beta2"])
    c.setdefault("corrected_epsilon", c["epsilon"])
    return c


def family_cases():
    out = []

    # Spectral descent as the README's Muon example (its Example 6): the first moment (betas[0]
    # 0.9, bias-corrected: the peer's defaults) orthogonalised by 5 Newton-Schulz steps and scaled
    # by sqrt(max(1, rows / cols)); tensors merged to 2-D (r3 [6, 5, 4] -> [6, 20], conv
    # [8, 4, 3, 3] -> [8, 36]; max_preconditioner_dim 1024 merges them as the example's math.inf
    # does), the 1-D bias by Adam (beta2 0.95, epsilon 1e-10) with the same first moment, decoupled
    # weight decay on both.
    c = family(preconditioner="spectral_descent", lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1,
               merge_from="last", beta1=0.9, bias_correction=1, graft="adam", graft_beta2=0.95,
               graft_epsilon=1e-10, graft_preconditioned=0, weight_decay=0.01, ns_scale="aspect")
    out.append(("spectral_descent_2d", c, [BIAS, M, W, WT, R3, CONV], [
        ("ns_steps 4", variant(c, ns_steps=4)),
        ("coefficients (3, -3.2, 1.2)", variant(c, ns_a=3.0, ns_b=-3.2, ns_c=1.2)),
        ("exact polar factor (SVD)", variant(c, peer_svd=True)),
        ("normalised by the spectral norm", variant(c, peer_patch=[(sdl, "matrix_orthogonalization",
                                                                    _orth_spectral_norm)])),
        ("no aspect scaling", variant(c, ns_scale="none")),
        ("first moment after the orthogonalisation (momentum 0.9, dampening 0.9: an EMA)",
         variant(c, peer_beta1=0.0, peer_momentum=(0.9, 0.9))),
        ("beta3 0.81 (Nesterov's form)", variant(c, peer_beta3=0.81)),
        ("first moment not bias-corrected", variant(c, peer_bias_correction=False)),
        ("orthogonalised blocks grafted by adam", variant(c, graft_preconditioned=1)),
        ("no weight decay", variant(c, weight_decay=0.0)),
    ]))

    # Blocks: max_preconditioner_dim 16 cuts w [24, 16] into [16, 16] + [8, 16], wt [16, 40] into
    # [16, 16] x 2 + [16, 8] and big [40, 20] into 3 x 2 blocks, each orthogonalised on its own
    # (m [12, 10] stays whole); plain first moment, Muon's coefficients, no scaling.
    c = family(preconditioner="spectral_descent", lr=2.0**-7, max_preconditioner_dim=16, merge_small_dims=1,
               merge_from="last", beta1=0.9, bias_correction=1, graft="adam", graft_beta2=0.95,
               graft_epsilon=1e-10, graft_preconditioned=0)
    out.append(("spectral_descent_blocked", c, [M, W, WT, BIG], [
        ("one block per tensor", variant(c, peer_max_preconditioner_dim=1024)),
        ("ns_steps 6", variant(c, ns_steps=6)),
    ]))

    # The peer's defaults: DistributedShampoo(params, lr=2^-7,
    # preconditioner_config=DefaultSpectralDescentPreconditionerConfig): betas (0.9, 1.0) with
    # bias correction (which spectral descent cannot see: the orthogonalisation is scale-free),
    # max_preconditioner_dim 1024, target_parameter_dimensionality forced to 2, no grafting, no
    # scaling, 5 steps of (3.4445, -4.7750, 2.0315). Matrices and a rank-3 tensor only (the peer
    # raises for a 1-D tensor here).
    c = family(preconditioner="spectral_descent", lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1,
               merge_from="last", beta1=0.9, bias_correction=1, graft="none", graft_preconditioned=0,
               epsilon=1e-12, precondition_1d=0, preset="spectral_descent_defaults")
    out.append(("spectral_descent_defaults", c, [M, W, WT, R3], [
        ("no first moment (betas (0, 1))", variant(c, peer_preset_overrides={"betas": (0.0, 1.0)})),
        ("aspect scaling", variant(c, peer_preconditioner=ds.SpectralDescentPreconditionerConfig(
            orthogonalization_config=ds.NewtonSchulzOrthogonalizationConfig(scale_by_dims_fn=_scale_aspect)))),
    ]))

    # Eigenvalue-corrected Shampoo with eigh, the README's SOAP betas (0.9, 0.999), bias
    # correction, decoupled weight decay, no grafting; the eigenbasis at steps 6, 9, 12, ...
    # (steps 1 to 5 in the identity basis: Adam); no merging: b6 [6] one 6 x 6 factor, r3 three
    # factors, low [64, 48] rank-2 gradients (62 and 46 zero eigenvalues for good). Every
    # eigenbasis must be well defined where the gradients have components: an eigenvalue
    # repeated (the zeros of a rank-deficient factor) leaves its eigenvectors arbitrary, and the
    # per-coordinate division then depends on the choice (the gradient's components in that
    # space are divided coordinate by coordinate). So the factors are full rank when the basis
    # is computed (b6 from step 6, m [12, 10] from step 2), or the gradients stay in the factor's
    # range (low: fixed subspaces), whose zero eigenspace they never touch.
    c = family(preconditioner="eigenvalue_corrected", lr=2.0**-7, merge_small_dims=0, beta1=0.9, beta2=0.999,
               bias_correction=1, epsilon=1e-5, precondition_frequency=3, start_preconditioning_step=6,
               graft="none", precondition_1d=1, weight_decay=0.01, eigenbasis="eigh")
    out.append(("soap_eigh", c, [B6, M, R3, LOW], [
        ("epsilon inside the root", variant(c, peer_patch=[(EC_LIST, "_compute_preconditioned_gradient",
                                                            _ec_precondition(eps_inside=True))])),
        ("corrected eigenvalues not bias-corrected", variant(c, peer_patch=[(
            EC_LIST, "_compute_preconditioned_gradient", _ec_precondition(bias_correct=False))])),
        ("no bias correction", variant(c, peer_bias_correction=False)),
        ("corrected beta2 0.99", variant(c, peer_patch=[(EC_LIST, "update_preconditioners", _ec_update(0.99))])),
        ("beta2 0.99", variant(c, beta2=0.99, corrected_beta2=0.99)),
        ("gradient preconditioned, no first moment", variant(c, peer_beta1=0.0)),
        ("first moment after the preconditioner (momentum 0.9, dampening 0.9: an EMA)",
         variant(c, peer_beta1=0.0, peer_momentum=(0.9, 0.9))),
        ("eigenvectors in descending order", variant(c, peer_patch=[(spl, "matrix_eigendecomposition",
                                                                     _eig_descending)])),
        ("exponent 1/4", variant(c, peer_corrected_exponent=4)),
        ("eigenbasis every step from step 6", variant(c, peer_precondition_frequency=1)),
        ("epsilon 1e-3", variant(c, epsilon=1e-3, corrected_epsilon=1e-3)),
        ("no weight decay", variant(c, weight_decay=0.0)),
    ]))

    # The same family with the QR refresh: one QR step of Q^T (S + eps I) Q from the previous
    # basis (the identity the first time), estimates sorted ascending, every second step from
    # step 6; max_preconditioner_dim 16 cuts w [24, 16] into [16, 16] + [8, 16]. Full-rank
    # factors only: one QR step leaves the zero eigenspace of a rank-deficient factor mixed with
    # its range at an angle of about (rounding of S) / eps, and the ascending sort then orders
    # the ridge's tied estimates by rounding: low [64, 48] with QR lands 1e-3 to 3 (eps 0.3 to
    # 1e-5) from the float64 run in the peer's own float32 run, depending on the schedule, so no
    # case here takes a rank-deficient factor with QR (soap_eigh takes low with eigh).
    c = family(preconditioner="eigenvalue_corrected", lr=2.0**-7, merge_small_dims=0, max_preconditioner_dim=16,
               beta1=0.9, beta2=0.999, bias_correction=1, epsilon=1e-5, precondition_frequency=2,
               start_preconditioning_step=6, graft="none", precondition_1d=1, eigenbasis="qr", qr_iterations=1)
    out.append(("soap_qr", c, [B6, M, R3, W], [
        ("eigh in place of QR", variant(c, peer_eigenbasis="eigh")),
        ("two QR iterations", variant(c, peer_qr_iterations=2)),
        ("QR from the identity at every refresh", variant(c, peer_patch=[(spl, "matrix_eigendecomposition",
                                                                          _eig_cold_qr)])),
        ("QR estimates not sorted", variant(c, peer_patch=[(spl, "matrix_eigendecomposition",
                                                            _eig_unsorted_qr)])),
        ("no ridge before QR", variant(c, peer_no_ridge=True)),
        ("epsilon inside the root", variant(c, peer_patch=[(EC_LIST, "_compute_preconditioned_gradient",
                                                            _ec_precondition(eps_inside=True))])),
        ("gradient preconditioned, no first moment", variant(c, peer_beta1=0.0)),
        ("one block per tensor", variant(c, peer_max_preconditioner_dim=1024)),
    ]))

    # DefaultSOAPConfig as the peer defines it, in DistributedShampoo's defaults:
    # DistributedShampoo(params, lr=2^-7, preconditioner_config=DefaultSOAPConfig) with the
    # reference's float64 dtypes: betas (0.9, 1.0) (summed factors and corrected eigenvalues,
    # weight 1), epsilon 1e-12, bias correction (of the first moment only, beta2 being 1), one QR
    # iteration every step from step 1, merging from the last dimension, no grafting. With eps
    # 1e-12 any rank-deficient factor makes float32 noise (see soap_qr), and the default merging
    # turns every tensor of at most 1024 elements into one full-matrix factor of rank t: the case
    # keeps to sq [36, 36], whose two factors are full rank from step 1 (wide [40, 30] and big2
    # [48, 40] land 0.13 and 0.03 from the float64 run in float32).
    c = family(preconditioner="eigenvalue_corrected", lr=2.0**-7, max_preconditioner_dim=1024, merge_small_dims=1,
               merge_from="last", beta1=0.9, beta2=1.0, bias_correction=1, epsilon=1e-12, precondition_1d=1,
               graft="none", eigenbasis="qr", qr_iterations=1, preset="soap_defaults")
    out.append(("soap_defaults", c, [SQ], [
        ("no first moment (betas (0, 1))", variant(c, peer_preset_overrides={"betas": (0.0, 1.0)})),
        ("beta2 0.999", variant(c, peer_preset_overrides={"betas": (0.9, 0.999)})),
        ("eigh in place of QR (DefaultEigenvalueCorrectedShampooConfig)", variant(c, peer_eigenbasis="eigh")),
    ]))
    return out


# ---- the peer's float32 spread: its float32 run under rounding orders that leave the math alone ----
# (see peer_float32_spread in the docstring; run for the cases in SPREAD_CASES only)

SPREAD_CASES = {"soap_defaults"}


def _factor_operand(grad, k):
    """grad with dimension k first, flattened to (d_k, rest): factor k is A A^T (what the peer's
    tensordot contracts)."""
    return torch.movedim(grad, k, 0).reshape(grad.shape[k], -1)


def _outer_products(kind):
    """BaseShampooPreconditionerList._compute_outer_product_list with A A^T summed another way:
    the vectorised reduction of the elementwise products (sum), one rank-1 update per column in
    ascending or descending order (sequential, sequential_reversed), or in float64 rounded once to
    the run's dtype (f64)."""

    def outer(self, grad, order, preconditioned_dims_selector, kronecker_factors):
        out = []
        for k in compress_list(range(order), preconditioned_dims_selector):
            A = _factor_operand(grad, k)
            if kind == "sum":
                P = (A[:, None, :] * A[None, :, :]).sum(-1)
            elif kind in ("sequential", "sequential_reversed"):
                P = torch.zeros(A.shape[0], A.shape[0], dtype=A.dtype)
                cols = range(A.shape[1])
                for j in (reversed(cols) if kind == "sequential_reversed" else cols):
                    P.addr_(A[:, j], A[:, j])
            else:
                assert kind == "f64"
                P = (A.double() @ A.double().T).to(A.dtype)
            out.append(P)
        return tuple(out)

    return outer


_peer_precondition_grad = spl.BaseShampooPreconditionerList._precondition_grad


def _rotation(kind):
    """BaseShampooPreconditionerList._precondition_grad (the rotations into and out of the
    eigenbasis) with the dimensions contracted last to first (reversed), or in float64 rounded
    once (f64)."""

    def rotate(grad, preconditioned_dims_selector, preconditioner_list, dims=([0], [0])):
        if kind == "f64":
            return _peer_precondition_grad(grad=grad.double(), preconditioned_dims_selector=preconditioned_dims_selector,
                                           preconditioner_list=tuple(q.double() for q in preconditioner_list),
                                           dims=dims).to(grad.dtype)
        assert kind == "reversed"
        qs = dict(zip([k for k, sel in enumerate(preconditioned_dims_selector) if sel], preconditioner_list))
        X = grad.to(preconditioner_list[0].dtype) if preconditioner_list else grad
        for k in reversed(range(grad.ndim)):
            if k in qs:
                X = torch.movedim(torch.tensordot(X, qs[k], dims=([k], dims[1])), -1, k)
        return X.to(grad.dtype)

    return staticmethod(rotate)


def _qr_refresh(kind):
    """matrix_functions.py's matrix_eigendecomposition for QREigendecompositionConfig (the ridge,
    B = Q^T A Q, max_iterations QR steps, the stable ascending sort) with B formed as Q^T (A Q)
    (right_first), or each QR factorisation in float64 rounded to the run's dtype (f64)."""

    def eig(A, epsilon=0.0, eigendecomposition_config=None, eigenvectors_estimate=None):
        cfg = eigendecomposition_config
        if not isinstance(cfg, ds.QREigendecompositionConfig):
            return _peer_eig(A=A, epsilon=epsilon, eigendecomposition_config=cfg,
                             eigenvectors_estimate=eigenvectors_estimate)
        assert cfg.tolerance == 0.0 and cfg.rank_deficient_stability_config.perturb_before_computation
        A = A.add(torch.eye(A.shape[0], dtype=A.dtype), alpha=epsilon)
        Q = eigenvectors_estimate
        B = Q.T @ (A @ Q) if kind == "right_first" else (Q.T @ A) @ Q
        for _ in range(cfg.max_iterations):
            if not torch.any(B - torch.diag(B.diag())):  # the peer's criterion with tolerance 0
                break
            if kind == "f64":
                q, r = (x.to(B.dtype) for x in torch.linalg.qr(B.double()))
            else:
                q, r = torch.linalg.qr(B)
            B = r @ q
            Q = Q @ q
        L, indices = B.diag().sort(stable=True)
        return L, Q[:, indices]

    return eig


BASE_LIST = spl.BaseShampooPreconditionerList
# (label, threads for the float32 run, peer_patch entries, environment of a fresh process or None)
SPREAD_VARIANTS = [
    ("threads_2", 2, [], None),
    ("threads_4", 4, [], None),
    ("factor_summed", 1, [(BASE_LIST, "_compute_outer_product_list", _outer_products("sum"))], None),
    ("factor_sequential", 1, [(BASE_LIST, "_compute_outer_product_list", _outer_products("sequential"))], None),
    ("factor_sequential_reversed", 1, [(BASE_LIST, "_compute_outer_product_list",
                                        _outer_products("sequential_reversed"))], None),
    ("factor_float64_rounded", 1, [(BASE_LIST, "_compute_outer_product_list", _outer_products("f64"))], None),
    ("rotation_reversed", 1, [(BASE_LIST, "_precondition_grad", _rotation("reversed"))], None),
    ("rotation_float64_rounded", 1, [(BASE_LIST, "_precondition_grad", _rotation("f64"))], None),
    ("qr_QtAQ_right_first", 1, [(spl, "matrix_eigendecomposition", _qr_refresh("right_first"))], None),
    ("qr_float64_rounded", 1, [(spl, "matrix_eigendecomposition", _qr_refresh("f64"))], None),
    ("mkl_cbwr_compatible", 1, [], {"MKL_CBWR": "COMPATIBLE"}),
]


def float32_distance(name, c, tensors, ref, scale, record, threads=1, patches=(), env=None):
    """The peer's float32 run's distance from ref (in scale units, every recorded step), with
    `threads` intra-op threads and the peer's code patched, or (env) measured by a fresh process of
    this script in that environment against its own float64 run."""
    if env is not None:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--float32-distance", name],
                             env=dict(os.environ, **env), check=True, capture_output=True, text=True).stdout
        return float(out.split()[-1])
    v = dict(c, peer_patch=list(c.get("peer_patch", [])) + list(patches))
    torch.set_num_threads(threads)
    try:
        f32 = run_peer(v, tensors, torch.float32, record)
    finally:
        torch.set_num_threads(1)
    return max_scaled_diff(f32, ref, scale)


def float32_spread(name, c, tensors, ref, scale, record, plain):
    """The largest distance over the plain float32 run (its distance: plain) and SPREAD_VARIANTS,
    as (label, value), and every (label, value)."""
    each = [("plain", plain)] + [
        (label, float32_distance(name, c, tensors, ref, scale, record, threads, patches, env))
        for label, threads, patches, env in SPREAD_VARIANTS]
    return max(each, key=lambda x: x[1]), each


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
    if c.get("family", False):  # the Shampoo family's cases
        keys += ["preconditioner", "graft_preconditioned"]
        if c["preconditioner"] == "spectral_descent":
            keys += ["ns_steps", "ns_a", "ns_b", "ns_c", "ns_epsilon", "ns_scale"]
        else:
            keys += ["eigenbasis", "qr_iterations", "qr_tolerance", "corrected_beta2", "corrected_epsilon",
                     "corrected_exponent"]
    return "opt " + " ".join("%s=%s" % (k, c[k] if isinstance(c[k], str) else repr(c[k])) for k in keys)


def reference(c, tensors):
    record = sorted({1, c["start_preconditioning_step"], STEPS // 2, STEPS})
    ref = run_peer(c, tensors, torch.float64, record)
    scale = max(float(np.max(np.abs(ref[STEPS][t.name] - t.param0().astype(np.float64)))) for t in tensors)
    return record, ref, scale


def main():
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--float32-distance"]:  # a spread variant's fresh process (float32_distance)
        (c, tensors), = [(c, t) for n, c, t, _ in cases() if n == sys.argv[2]]
        record, ref, scale = reference(c, tensors)
        print("float32_distance %r" % max_scaled_diff(run_peer(c, tensors, torch.float32, record), ref, scale))
        return
    os.makedirs(OUT, exist_ok=True)
    versions = peer_refs.versions(("numpy", np.__version__), ("torch", torch.__version__))
    only = set(sys.argv[1:])
    for name, c, tensors, wrong in cases():
        if only and name not in only:
            continue
        record, ref, scale = reference(c, tensors)
        f32 = run_peer(c, tensors, torch.float32, record)
        lines = peer_refs.header("Shampoo", __file__, "peer: " + PEER, versions) + [
            "case " + name,
            "source DistributedShampoo, options mapped as in make_shampoo_refs.py",
            opt_line(c),
            "steps %d" % STEPS,
            "scale %r" % scale,
            "peer_float32 %r" % max_scaled_diff(f32, ref, scale)]
        if name in SPREAD_CASES:
            (label, worst), each = float32_spread(name, c, tensors, ref, scale, record,
                                                  max_scaled_diff(f32, ref, scale))
            lines.append("peer_float32_spread %r %s" % (worst, label))
            print(name, "float32 spread:", ", ".join("%s %.3g" % e for e in each), flush=True)
        for label, w in wrong:
            d = max_scaled_diff(run_peer(w, tensors, torch.float64, [STEPS]), {STEPS: ref[STEPS]}, scale)
            if label.startswith("double: "):
                lines.append("sensitivity_double %r %s" % (d, label[len("double: "):].replace(" ", "_")))
            else:
                lines.append("sensitivity %r %s" % (d, label.replace(" ", "_")))
        for t in tensors:
            lines.append(t.line())
            if c.get("family"):
                shape, blocks = family_plan(t, c)
                lines.append("plan %s %d %s blocks %d" % (
                    t.name, len(shape) if shape else 0, " ".join(str(d) for d in shape) if shape else "-", blocks))
                continue
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
