#!/usr/bin/env python3
"""Reference vectors for gradapt's optimizers (tests/test_optim_refs.cpp), from optax and PyTorch.

Usage (not run by CI; the outputs under tests/data/optim/ are committed):

    python3 -m venv /tmp/refs && /tmp/refs/bin/pip install jax optax torch
    /tmp/refs/bin/python tests/data/make_optim_refs.py            # writes tests/data/optim/*.txt

Inputs are not stored: parameters and gradients come from a counter-based generator
(peer_refs.py) that the C++ test reproduces bit for bit (splitmix64 of seed * 0x100000001b3 + i,
the top 24 bits as a signed integer k, value = k * 2^-23 * scale with scale a power of two, so
every value is exact in float32). Each file holds the case's optimizer and options, the tensors (shape, seeds,
scales, masks, injected inf/NaN), and the parameters after the first and the last step:
every element for tensors up to 1024 elements, about 512 evenly strided elements of larger
ones, plus the float64 sum and sum of squares of the whole tensor.

Differences are measured against the case's "scale", the largest distance any parameter moved
from its start (finite elements), so a tolerance means "this fraction of what the optimizer
did". Each case also records how far three deliberately wrong variants of the optimizer land
from the reference in that unit ("sensitivity"), so the C++ test can check that its tolerance
separates a correct implementation from a plausible mistake (eps inside the root, no trust
ratio, a missing mask, ...).
"""

import os
import sys

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_refs  # noqa: E402  (the generator, the tensor record, the writer)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim")
SAMPLE_LIMIT = 1024  # tensors up to this size are stored whole
SAMPLE_COUNT = 512   # larger ones: about this many evenly strided elements

# ---- tensors (the generator: peer_refs.values, mirrored by tests/support/counter_random.hpp) ----


class T(peer_refs.Tensor):
    def __init__(self, name, shape, pseed, gseed, plog=0, glog=-3, zero_p=False, zero_g=False,
                 no_wd=False, no_tr=False, inject=()):
        super().__init__(name, shape, pseed, gseed, plog, glog)
        self.zero_p, self.zero_g, self.no_wd, self.no_tr = zero_p, zero_g, no_wd, no_tr
        self.inject = tuple(inject)  # (step, index, value)

    def param0(self):
        if self.zero_p:
            return np.zeros(self.shape, np.float32)
        return self.flat_param0().reshape(self.shape)

    def grad(self, step):  # step is 1-based
        if self.zero_g:
            return np.zeros(self.shape, np.float32)
        g = self.flat_grad(step)
        for s, i, v in self.inject:
            if s == step:
                g[i] = v
        return g.reshape(self.shape)

    def line(self):
        flags = [f for f in ("zero_p", "zero_g", "no_wd", "no_tr") if getattr(self, f)]
        out = "%s %s" % (super().line(), ",".join(flags) if flags else "-")
        return out + "".join(" inject %d %d %r" % (s, i, float(v)) for s, i, v in self.inject)


def standard_tensors():
    return [
        T("bias", [37], 11, 12, no_wd=True),
        T("emb", [64, 48], 21, 22, no_tr=True),
        T("big", [515, 257], 31, 32),  # large 2-D: > 128 Ki elements (parallel host paths)
        T("conv", [3, 5, 7], 41, 42, glog=-1),
        T("col", [1, 9, 1], 51, 52, no_wd=True),  # size-1 dims
        T("scalar", [], 61, 62),  # rank 0
        T("empty", [0, 4], 71, 72),
        T("zero_w", [16], 81, 82, zero_p=True),
        T("zero_g", [16], 91, 92, zero_g=True),
        T("denorm", [24], 101, 102, glog=-126),  # subnormal float32 gradients
    ]


def nonfinite_tensors():
    return [
        T("ok", [40], 11, 12),
        T("nan_g", [33], 21, 22, inject=[(2, 3, float("nan"))]),
        T("inf_g", [17], 31, 32, inject=[(1, 0, float("inf"))]),
        T("ninf_g", [5, 3], 41, 42, inject=[(3, 7, float("-inf"))]),
    ]


# ---- runners ----------------------------------------------------------------------------------


def run_optax(tx, tensors, steps):
    params = {t.name: jnp.asarray(t.param0()) for t in tensors}
    state = tx.init(params)

    @jax.jit
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    snaps = {}
    for s in range(1, steps + 1):
        grads = {t.name: jnp.asarray(t.grad(s)) for t in tensors}
        params, state = update(params, state, grads)
        if s in (1, steps):
            snaps[s] = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    return snaps


def run_torch(make, tensors, steps):
    torch.manual_seed(0)
    ps = {t.name: torch.nn.Parameter(torch.from_numpy(t.param0().copy())) for t in tensors}
    opt = make(ps)
    snaps = {}
    for s in range(1, steps + 1):
        for t in tensors:
            ps[t.name].grad = torch.from_numpy(t.grad(s).copy())
        opt.step()
        if s in (1, steps):
            snaps[s] = {k: v.detach().numpy().astype(np.float32).copy() for k, v in ps.items()}
    return snaps


def groups(ps, tensors, **kw):
    """torch param groups: weight decay 0 for no_wd tensors."""
    wd = kw.pop("weight_decay", 0.0)
    a = [ps[t.name] for t in tensors if not t.no_wd]
    b = [ps[t.name] for t in tensors if t.no_wd]
    return [dict(params=a, weight_decay=wd, **kw), dict(params=b, weight_decay=0.0, **kw)]


def wd_mask(tensors):
    return {t.name: not t.no_wd for t in tensors}


def tr_mask(tensors):
    return {t.name: not t.no_tr for t in tensors}


def lamb_chain(tensors, lr, b1, b2, eps, eps_root, wd, clip=None):
    parts = []
    if clip is not None:
        parts.append(optax.clip_by_global_norm(clip))
    parts += [
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
        optax.add_decayed_weights(wd, mask=wd_mask(tensors)),
        optax.masked(optax.scale_by_trust_ratio(), tr_mask(tensors)),
        optax.scale_by_learning_rate(lr),
    ]
    return optax.chain(*parts)


def lars_tx(tensors, **kw):
    return optax.lars(weight_decay_mask=wd_mask(tensors), trust_ratio_mask=tr_mask(tensors), **kw)


# ---- cases ------------------------------------------------------------------------------------
# Each case: name, source, optimizer line for the C++ test (gradapt preset + options), the
# tensors, steps, the reference runner, and three wrong variants for the sensitivity record.

STEPS = 6


def cases():
    std = standard_tensors()
    nf = nonfinite_tensors()
    out = []

    def add(name, source, opt, tensors, run, wrong):
        out.append((name, source, opt, tensors, run, wrong))

    # SGD ---------------------------------------------------------------------------------------
    add("sgd_momentum_optax", "optax.chain(add_decayed_weights(0.01, mask), sgd(0.05, momentum=0.9))",
        "sgd lr=0.05 momentum=0.9 nesterov=0 weight_decay=0.01", std,
        lambda ts: run_optax(optax.chain(optax.add_decayed_weights(0.01, mask=wd_mask(ts)),
                                         optax.sgd(0.05, momentum=0.9)), ts, STEPS),
        [("no momentum", lambda ts: run_optax(optax.chain(optax.add_decayed_weights(0.01, mask=wd_mask(ts)),
                                                          optax.sgd(0.05)), ts, STEPS)),
         ("nesterov", lambda ts: run_optax(optax.chain(optax.add_decayed_weights(0.01, mask=wd_mask(ts)),
                                                       optax.sgd(0.05, momentum=0.9, nesterov=True)), ts, STEPS)),
         ("no mask", lambda ts: run_optax(optax.chain(optax.add_decayed_weights(0.01),
                                                      optax.sgd(0.05, momentum=0.9)), ts, STEPS))])
    add("sgd_nesterov_torch", "torch.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)",
        "sgd lr=0.05 momentum=0.9 nesterov=1 weight_decay=0.01", std,
        lambda ts: run_torch(lambda ps: torch.optim.SGD(groups(ps, ts, lr=0.05, momentum=0.9, nesterov=True,
                                                               weight_decay=0.01)), ts, STEPS),
        [("no nesterov", lambda ts: run_torch(lambda ps: torch.optim.SGD(
            groups(ps, ts, lr=0.05, momentum=0.9, weight_decay=0.01)), ts, STEPS)),
         ("momentum 0.8", lambda ts: run_torch(lambda ps: torch.optim.SGD(
             groups(ps, ts, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01)), ts, STEPS)),
         ("no weight decay", lambda ts: run_torch(lambda ps: torch.optim.SGD(
             groups(ps, ts, lr=0.05, momentum=0.9, nesterov=True)), ts, STEPS))])
    add("sgd_plain_torch", "torch.optim.SGD(lr=0.1)", "sgd lr=0.1 momentum=0 nesterov=0 weight_decay=0", std,
        lambda ts: run_torch(lambda ps: torch.optim.SGD(list(ps.values()), lr=0.1), ts, STEPS),
        [("lr 0.099", lambda ts: run_torch(lambda ps: torch.optim.SGD(list(ps.values()), lr=0.099), ts, STEPS)),
         ("momentum 0.1", lambda ts: run_torch(lambda ps: torch.optim.SGD(list(ps.values()), lr=0.1,
                                                                            momentum=0.1), ts, STEPS)),
         ("weight decay 1e-3", lambda ts: run_torch(lambda ps: torch.optim.SGD(list(ps.values()), lr=0.1,
                                                                                 weight_decay=1e-3), ts, STEPS))])

    # AdamW -------------------------------------------------------------------------------------
    def adamw_o(ts, **kw):
        return run_optax(optax.adamw(mask=wd_mask(ts), **kw), ts, STEPS)

    add("adamw_optax", "optax.adamw(0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1, mask)",
        "adamw lr=0.01 b1=0.8 b2=0.95 eps=1e-3 eps_root=0 weight_decay=0.1 bias_correction=1", std,
        lambda ts: adamw_o(ts, learning_rate=0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1),
        [("eps inside the root", lambda ts: adamw_o(ts, learning_rate=0.01, b1=0.8, b2=0.95, eps=0.0,
                                                    eps_root=1e-6, weight_decay=0.1)),
         ("b2 0.96", lambda ts: adamw_o(ts, learning_rate=0.01, b1=0.8, b2=0.96, eps=1e-3, weight_decay=0.1)),
         ("no mask", lambda ts: run_optax(optax.adamw(0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1), ts,
                                          STEPS))])
    add("adamw_eps_root_optax", "optax.adamw(0.02, eps=1e-8, eps_root=1e-4, weight_decay=0.0)",
        "adamw lr=0.02 b1=0.9 b2=0.999 eps=1e-8 eps_root=1e-4 weight_decay=0 bias_correction=1", std,
        lambda ts: adamw_o(ts, learning_rate=0.02, eps=1e-8, eps_root=1e-4, weight_decay=0.0),
        [("eps_root 0", lambda ts: adamw_o(ts, learning_rate=0.02, eps=1e-8, eps_root=0.0, weight_decay=0.0)),
         ("eps outside", lambda ts: adamw_o(ts, learning_rate=0.02, eps=1e-2, eps_root=0.0, weight_decay=0.0)),
         ("b1 0.85", lambda ts: adamw_o(ts, learning_rate=0.02, b1=0.85, eps=1e-8, eps_root=1e-4,
                                        weight_decay=0.0))])

    def adamw_t(ts, **kw):
        return run_torch(lambda ps: torch.optim.AdamW(groups(ps, ts, **kw), foreach=False), ts, STEPS)

    add("adamw_torch", "torch.optim.AdamW(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)",
        "adamw lr=0.01 b1=0.9 b2=0.999 eps=1e-8 eps_root=0 weight_decay=0.01 bias_correction=1", std,
        lambda ts: adamw_t(ts, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        [("coupled decay (Adam)", lambda ts: run_torch(lambda ps: torch.optim.Adam(
            groups(ps, ts, lr=0.01, weight_decay=0.01)), ts, STEPS)),
         ("weight decay 0.02", lambda ts: adamw_t(ts, lr=0.01, weight_decay=0.02)),
         ("b1 0.95", lambda ts: adamw_t(ts, lr=0.01, betas=(0.95, 0.999), weight_decay=0.01))])
    add("adamw_torch_fused_eps", "torch.optim.AdamW(lr=0.003, betas=(0.5, 0.9), eps=0.1, weight_decay=0.5, fused=True)",
        "adamw lr=0.003 b1=0.5 b2=0.9 eps=0.1 eps_root=0 weight_decay=0.5 bias_correction=1", std,
        lambda ts: run_torch(lambda ps: torch.optim.AdamW(groups(ps, ts, lr=0.003, betas=(0.5, 0.9), eps=0.1,
                                                                 weight_decay=0.5), fused=True), ts, STEPS),
        [("eps 0.09", lambda ts: adamw_t(ts, lr=0.003, betas=(0.5, 0.9), eps=0.09, weight_decay=0.5)),
         ("amsgrad", lambda ts: run_torch(lambda ps: torch.optim.AdamW(groups(
             ps, ts, lr=0.003, betas=(0.5, 0.9), eps=0.1, weight_decay=0.5, amsgrad=True)), ts, STEPS)),
         ("b2 0.91", lambda ts: adamw_t(ts, lr=0.003, betas=(0.5, 0.91), eps=0.1, weight_decay=0.5))])

    # LAMB --------------------------------------------------------------------------------------
    add("lamb_optax", "optax.chain(scale_by_adam(eps=1e-6), add_decayed_weights(0.01, mask), "
        "masked(scale_by_trust_ratio(), tr_mask), scale_by_learning_rate(0.01))",
        "lamb lr=0.01 b1=0.9 b2=0.999 eps=1e-6 eps_root=0 weight_decay=0.01 bias_correction=1", std,
        lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-6, 0.0, 0.01), ts, STEPS),
        [("no trust ratio", lambda ts: run_optax(optax.chain(
            optax.scale_by_adam(eps=1e-6), optax.add_decayed_weights(0.01, mask=wd_mask(ts)),
            optax.scale_by_learning_rate(0.01)), ts, STEPS)),
         ("trust ratio before decay", lambda ts: run_optax(optax.chain(
             optax.scale_by_adam(eps=1e-6), optax.masked(optax.scale_by_trust_ratio(), tr_mask(ts)),
             optax.add_decayed_weights(0.01, mask=wd_mask(ts)), optax.scale_by_learning_rate(0.01)), ts, STEPS)),
         ("no trust mask", lambda ts: run_optax(optax.lamb(0.01, weight_decay=0.01, mask=wd_mask(ts)), ts,
                                                STEPS))])
    # Without weight decay a subnormal gradient gives a tiny update whose float32 norm
    # underflows to 0 in optax (r = 1), while gradapt's double norm is exact (r = |p|/|u|):
    # that tensor is left out here and checked against a long double re-computation instead.
    no_denorm = [t for t in std if t.name != "denorm"]
    add("lamb_optax_default", "optax.lamb(0.02)  (eps 1e-6, no weight decay, no masks; no subnormal tensor)",
        "lamb lr=0.02 b1=0.9 b2=0.999 eps=1e-6 eps_root=0 weight_decay=0 bias_correction=1 masks=0", no_denorm,
        lambda ts: run_optax(optax.lamb(0.02), ts, STEPS),
        [("b2 0.99", lambda ts: run_optax(optax.lamb(0.02, b2=0.99), ts, STEPS)),
         ("eps 1e-3", lambda ts: run_optax(optax.lamb(0.02, eps=1e-3), ts, STEPS)),
         ("lr 0.0199", lambda ts: run_optax(optax.lamb(0.0199), ts, STEPS))])
    add("lamb_clip_optax", "optax.chain(clip_by_global_norm(0.5), <lamb_optax chain with lr 0.01, wd 0.05>)",
        "lamb lr=0.01 b1=0.9 b2=0.999 eps=1e-6 eps_root=0 weight_decay=0.05 bias_correction=1 max_grad_norm=0.5",
        std, lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-6, 0.0, 0.05, clip=0.5), ts, STEPS),
        [("no clip", lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-6, 0.0, 0.05), ts, STEPS)),
         ("clip 0.6", lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-6, 0.0, 0.05, clip=0.6), ts, STEPS)),
         ("eps 1e-4", lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-4, 0.0, 0.05, clip=0.5), ts,
                                           STEPS))])
    add("lamb_nonfinite_optax", "the lamb_optax chain with inf/NaN gradients injected",
        "lamb lr=0.01 b1=0.9 b2=0.999 eps=1e-6 eps_root=0 weight_decay=0.01 bias_correction=1", nf,
        lambda ts: run_optax(lamb_chain(ts, 0.01, 0.9, 0.999, 1e-6, 0.0, 0.01), ts, STEPS), [])
    add("adamw_nonfinite_optax", "optax.adamw(0.01) with inf/NaN gradients injected",
        "adamw lr=0.01 b1=0.9 b2=0.999 eps=1e-8 eps_root=0 weight_decay=1e-4 bias_correction=1", nf,
        lambda ts: adamw_o(ts, learning_rate=0.01), [])

    # LARS --------------------------------------------------------------------------------------
    add("lars_optax", "optax.lars(0.5, weight_decay=0.01, trust_coefficient=0.02, eps=1e-5, masks, momentum=0.9)",
        "lars lr=0.5 weight_decay=0.01 trust_coefficient=0.02 eps=1e-5 momentum=0.9 nesterov=0", std,
        lambda ts: run_optax(lars_tx(ts, learning_rate=0.5, weight_decay=0.01, trust_coefficient=0.02,
                                     eps=1e-5), ts, STEPS),
        [("nesterov", lambda ts: run_optax(lars_tx(ts, learning_rate=0.5, weight_decay=0.01,
                                                   trust_coefficient=0.02, eps=1e-5, nesterov=True), ts, STEPS)),
         ("no trust mask", lambda ts: run_optax(optax.lars(0.5, weight_decay=0.01, weight_decay_mask=wd_mask(ts),
                                                           trust_coefficient=0.02, eps=1e-5), ts, STEPS)),
         ("trust coefficient 0.021", lambda ts: run_optax(lars_tx(ts, learning_rate=0.5, weight_decay=0.01,
                                                                  trust_coefficient=0.021, eps=1e-5), ts, STEPS))])
    add("lars_nesterov_optax", "optax.lars(1.0, weight_decay=1e-3, masks, momentum=0.8, nesterov=True)",
        "lars lr=1 weight_decay=1e-3 trust_coefficient=0.001 eps=0 momentum=0.8 nesterov=1", std,
        lambda ts: run_optax(lars_tx(ts, learning_rate=1.0, weight_decay=1e-3, momentum=0.8, nesterov=True),
                             ts, STEPS),
        [("no nesterov", lambda ts: run_optax(lars_tx(ts, learning_rate=1.0, weight_decay=1e-3, momentum=0.8),
                                              ts, STEPS)),
         ("momentum 0.85", lambda ts: run_optax(lars_tx(ts, learning_rate=1.0, weight_decay=1e-3, momentum=0.85,
                                                        nesterov=True), ts, STEPS)),
         ("no weight decay", lambda ts: run_optax(lars_tx(ts, learning_rate=1.0, momentum=0.8, nesterov=True),
                                                  ts, STEPS))])
    return out


# ---- output -----------------------------------------------------------------------------------


def tensor_records(snap, tensors, step):
    lines = []
    for t in tensors:
        a = snap[t.name].reshape(-1)
        stride = 1 if a.size <= SAMPLE_LIMIT else -(-a.size // SAMPLE_COUNT)
        sample = a[::stride]
        a64 = a.astype(np.float64)
        lines.append("result %d %s stride %d count %d sum %r sumsq %r" % (
            step, t.name, stride, sample.size, float(a64.sum()), float((a64 * a64).sum())))
        lines.append(" ".join("%.9g" % v if np.isfinite(v) else str(float(v)).lower() for v in sample))
    return lines


def movement_scale(final, tensors):
    """The largest |p_last - p_0| over all finite elements: the scale of what the optimizer
    did, against which differences are measured (float32 implementations that order their
    operations differently, or round a bias correction in float32 as optax does, differ by a
    small fraction of it)."""
    worst = 0.0
    for t in tensors:
        d = np.abs(final[t.name].astype(np.float64) - t.param0().astype(np.float64))
        d = d[np.isfinite(d)]
        if d.size:
            worst = max(worst, float(d.max()))
    return worst


def max_scaled_diff(a, b, tensors, scale):
    """Largest |a - b| / scale over elements finite in both."""
    worst = 0.0
    for t in tensors:
        x, y = a[t.name].astype(np.float64), b[t.name].astype(np.float64)
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.any():
            worst = max(worst, float(np.max(np.abs(x[ok] - y[ok]))) / scale)
    return worst


def case_lines(what, script, versions, name, source, opt, tensors, snaps, wrong):
    """A case file of this script's format (make_factored_refs.py writes the same): the header,
    the options, the movement scale, the wrong variants' distances, the tensors and the
    records after each step of snaps."""
    lines = peer_refs.header(what, script, versions) + [
        "case " + name,
        "source " + source,
        "opt " + opt,
        "steps %d" % STEPS]
    scale = movement_scale(snaps[STEPS], tensors)
    lines.append("scale %r" % scale)
    for label, w in wrong:
        d = max_scaled_diff(w(tensors)[STEPS], snaps[STEPS], tensors, scale)
        lines.append("sensitivity %r %s" % (d, label.replace(" ", "_")))
    lines += [t.line() for t in tensors]
    for s in sorted(snaps):
        lines += tensor_records(snaps[s], tensors, s)
    lines.append("end")
    return lines


def main():
    os.makedirs(OUT, exist_ok=True)
    versions = peer_refs.versions(("numpy", np.__version__), ("jax", jax.__version__), ("optax", optax.__version__),
                                  ("torch", torch.__version__))
    for name, source, opt, tensors, run, wrong in cases():
        lines = case_lines("optimizer", __file__, versions, name, source, opt, tensors, run(tensors), wrong)
        peer_refs.write_case(OUT, name, lines)


if __name__ == "__main__":
    main()
