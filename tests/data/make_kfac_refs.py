#!/usr/bin/env python3
"""Reference data for gradapt::kfac (tests/test_kfac_refs.cpp) from kfac-pytorch.

Usage (not run by CI; the outputs under tests/data/kfac/ are committed):

    python3 -m venv /tmp/kref && /tmp/kref/bin/pip install torch numpy kfac-pytorch
    /tmp/kref/bin/python tests/data/make_kfac_refs.py          # writes tests/data/kfac/*.txt

The peer is kfac-pytorch's KFACPreconditioner (gpauloski/kfac-pytorch; the version used is in
each file's header). The committed files were made with kfac-pytorch installed from its
repository at commit 869cf11 (git describe v0.4.2-153-g869cf11; it reports version 0.4.2) into
a venv with torch 2.15.0 (CPU): pip install --no-deps <checkout>. It wraps a small MLP, 6 -> 5 (tanh) -> 3, both layers torch.nn.Linear
with a bias, trained for STEPS steps of SGD on the loss 0.5 * sum((y - t)^2) over ROWS rows
(a sum, so the output gradients are O(1) and G has well-separated eigenvalues). Inputs,
targets and initial weights come from the counter-based generator of make_optim_refs.py
(exact in float32). SGD moves the model between steps on the gradient before
preconditioning, so every run of the peer (the reference and each wrong variant) sees the same
a, g and gradients. The peer computes its factors itself through its own module hooks; this
script adds hooks of its own after the peer's that only copy what the peer saw: each layer's
input a (forward pre-hook) and gradient with respect to its output g (full backward hook),
on the steps where the peer updates factors. Per step the file holds:

    M    the layer's gradient [dW | db] (out x (in + 1)) before preconditioning
    a, g the captured inputs and output gradients (on factor-update steps)
    A, G the peer's running factors after the step (on factor-update steps)
    the peer's decomposition (on inverse-update steps): eigen: dA, QA, dG, QG (and dgda, its
         1 / (dG dA^T + damping), with prediv); inverse: Ainv = (A + damping I)^-1, Ginv
    V    the gradient the peer writes back, [dW | db] after KL clipping
    nu   the peer's KL-clipping scale (the return value of its _compute_grad_scale)

All of these come from a float64 run of the peer (model, factor_dtype and inv_dtype float64).

Mapping to gradapt::kfac_options (gradapt on the left):
    factor_decay         = factor_decay (the peer's alpha of update_a_factor/update_g_factor)
    factor_update_steps  = factor_update_steps; inv_update_steps = inv_update_steps. The peer
                           counts steps from 0 and updates at steps s with s % k == 0; gradapt
                           counts from 1 and updates at t with (t - 1) % k == 0: the same steps.
    damping, kl_clip     = damping, kl_clip; the lr of gradapt's step is the peer's lr (which
                           the peer uses only inside KL clipping).
    method               = compute_method (eigen / inverse)
    prediv_eigenvalues   = compute_eigenvalue_outer_product (eigen only)
    accumulate(a, g, 1)  = the peer's hooks: a is the layer input, g is grad_output[0] as
                           autograd passes it (the peer does not multiply by the batch size;
                           get_cov divides g^T g by the rows, as gradapt does).
    bias = true          = the peer's append_bias_ones (the bias gradient is M's last column).
    The peer's factors start at the identity on the first update, as gradapt's do.

Differences that are not matched:
  * kfac-pytorch's compute_a_inv / compute_g_inv convert the factor to float32 before
    torch.linalg.eigh / torch.linalg.inv whatever inv_dtype is. For the float64 reference this
    script runs the peer's own source of those two methods with that one dtype replaced by
    float64 (float64_decompositions below: the text "torch.float32" -> "torch.float64", checked
    to occur); everything else is the installed package as is.
  * The peer's inverse method uses torch.linalg.inv (LU); gradapt builds (X + lambda I)^-1 from
    its eigendecomposition with the eigenvalues clamped at 0. For the positive semi-definite
    factors here both are the same matrix up to rounding.
  * The peer symmetrises its covariances ((C + C^T) / 2) and sums the KL term per layer in the
    model's dtype; gradapt uses a symmetric rank-k update and sums in double. Rounding only.
  * Eigenvectors are determined up to sign: they are compared column by column after aligning
    signs, and their differences are scaled by gap_j / max|d| (gap_j the distance of eigenvalue
    j to the nearest other one), the perturbation bound's unit.
  * The peer with kl_clip always clips (kl_clip > 0 is required); gradapt's kl_clip = 0 (off)
    has no counterpart and is not covered here.

Deviation units (the C++ test uses the same): a matrix record's deviation is max|x - r| /
max|r|; eigenvectors as above; nu's is |x - r| / |r|. The records are grouped into "factors"
(A, G), "decomposition" (dA, QA, dG, QG, dgda, Ainv, Ginv) and "gradient" (V, nu); each file
records per group:

    float32 <group> <d>    the largest deviation of the peer's own float32 run (same model,
                           inputs and options in float32, its default float32 decompositions)
                           from the float64 reference: the size of float32 rounding here;
    sensitivity <group> <d> <label>   the largest deviation of a deliberately wrong variant of
                           the peer (float64) from the reference.

The C++ test sets its float tolerance from the float32 line and checks that every wrong
variant lands well outside its tolerances in some group.
"""

import contextlib
import inspect
import os
import sys
import textwrap
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_refs  # noqa: E402  (the generator, the writer)

warnings.filterwarnings("ignore")
import kfac  # noqa: E402
import kfac.layers.eigen  # noqa: E402
import kfac.layers.inverse  # noqa: E402
import kfac.layers.modules  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kfac")
ROWS = 16
STEPS = 8
SIZES = [6, 5, 3]  # in -> hidden -> out
SGD_LR = 0.05      # the optimizer that moves the model between steps (not part of K-FAC)

# ---- the peer ---------------------------------------------------------------------------------


@contextlib.contextmanager
def float64_decompositions():
    """The peer's compute_a_inv / compute_g_inv with their hard-coded float32 made float64."""
    saved = []
    for cls in (kfac.layers.eigen.KFACEigenLayer, kfac.layers.inverse.KFACInverseLayer):
        module = sys.modules[cls.__module__]
        for name in ("compute_a_inv", "compute_g_inv"):
            src = textwrap.dedent(inspect.getsource(getattr(cls, name)))
            assert "torch.float32" in src, (cls, name)
            ns = {}
            exec(src.replace("torch.float32", "torch.float64"), vars(module), ns)
            saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, ns[name])
    try:
        yield
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)


@contextlib.contextmanager
def factors_from_zero():
    """Wrong variant: the running averages start from 0 instead of the identity."""
    base = kfac.layers.base.KFACBaseLayer
    ua, ug = base.update_a_factor, base.update_g_factor

    def wa(self, alpha=0.95):
        if self.a_factor is None and self._a_batch is not None:
            self.a_factor = torch.zeros_like(self._a_batch)
        ua(self, alpha)

    def wg(self, alpha=0.95):
        if self.g_factor is None and self._g_batch is not None:
            self.g_factor = torch.zeros_like(self._g_batch)
        ug(self, alpha)

    base.update_a_factor, base.update_g_factor = wa, wg
    try:
        yield
    finally:
        base.update_a_factor, base.update_g_factor = ua, ug


def make_model(dtype):
    torch.manual_seed(0)
    layers = []
    for li in range(len(SIZES) - 1):
        lin = torch.nn.Linear(SIZES[li], SIZES[li + 1])
        with torch.no_grad():
            w = peer_refs.values(100 + 10 * li, SIZES[li + 1] * SIZES[li], -1).reshape(SIZES[li + 1], SIZES[li])
            b = peer_refs.values(101 + 10 * li, SIZES[li + 1], -2)
            lin.weight.copy_(torch.from_numpy(w.astype(np.float64)))
            lin.bias.copy_(torch.from_numpy(b.astype(np.float64)))
        layers.append(lin)
        if li + 2 < len(SIZES):
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(dtype)


def batch(step, dtype):
    x = peer_refs.values(1000 + step, ROWS * SIZES[0], 0).reshape(ROWS, SIZES[0])
    t = peer_refs.values(2000 + step, ROWS * SIZES[-1], 0).reshape(ROWS, SIZES[-1])
    return torch.from_numpy(x.astype(np.float64)).to(dtype), torch.from_numpy(t.astype(np.float64)).to(dtype)


def run(opts, dtype, grad_scaler=None, factor_decay=None, kl_clip=None, method=None):
    """STEPS steps of the peer; per step a dict of records {(kind, layer): np.float64 array}."""
    model = make_model(dtype)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    kw = dict(factor_update_steps=opts["factor_update_steps"], inv_update_steps=opts["inv_update_steps"],
              damping=opts["damping"], factor_decay=opts["factor_decay"] if factor_decay is None else factor_decay,
              kl_clip=opts["kl_clip"] if kl_clip is None else kl_clip, lr=opts["lr"],
              compute_method=opts["method"] if method is None else method,
              compute_eigenvalue_outer_product=bool(opts["prediv"]),
              factor_dtype=dtype, inv_dtype=dtype, grad_scaler=grad_scaler, allreduce_bucket_cap_mb=0)
    pre = kfac.preconditioner.KFACPreconditioner(model, **kw)
    layers = [layer for _, layer in pre._layers.values()]
    assert [layer.module.module for layer in layers] == linears
    seen = {}
    for li, lin in enumerate(linears):
        lin.register_forward_pre_hook(lambda m, inp, li=li: seen.__setitem__(("a", li), inp[0].detach().clone()))
        lin.register_full_backward_hook(
            lambda m, gi, go, li=li: seen.__setitem__(("g", li), go[0].detach().clone()))
    nus = []
    scale = pre._compute_grad_scale

    def record_scale():
        nu = scale()
        nus.append(nu)
        return nu

    pre._compute_grad_scale = record_scale
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    out = []
    for s in range(STEPS):
        seen.clear()
        x, t = batch(s + 1, dtype)
        opt.zero_grad()
        loss = 0.5 * ((model(x) - t) ** 2).sum()
        loss.backward()
        rec = {}
        factors = s % opts["factor_update_steps"] == 0
        inverse = s % opts["inv_update_steps"] == 0
        for li, lin in enumerate(linears):
            rec[("M", li)] = torch.cat([lin.weight.grad, lin.bias.grad.view(-1, 1)], 1)
            if factors:
                rec[("a", li)] = seen[("a", li)]
                rec[("g", li)] = seen[("g", li)]
        pre.step()
        for li, (lin, layer) in enumerate(zip(linears, layers)):
            rec[("V", li)] = torch.cat([lin.weight.grad, lin.bias.grad.view(-1, 1)], 1)
            if factors:
                rec[("A", li)] = layer.a_factor
                rec[("G", li)] = layer.g_factor
            if inverse:
                if isinstance(layer, kfac.layers.eigen.KFACEigenLayer):
                    rec[("QA", li)] = layer.qa
                    rec[("QG", li)] = layer.qg
                    if layer.prediv_eigenvalues:
                        rec[("dgda", li)] = layer.dgda
                    else:
                        rec[("dA", li)] = layer.da
                        rec[("dG", li)] = layer.dg
                else:
                    rec[("Ainv", li)] = layer.a_inv
                    rec[("Ginv", li)] = layer.g_inv
        rec[("nu", 0)] = torch.tensor([nus[-1]], dtype=torch.float64)
        out.append({k: v.detach().to(torch.float64).numpy().copy() for k, v in rec.items()})
        # The model moves on the gradient before preconditioning, so every run (right or wrong
        # variant) sees the same a, g and M.
        for li, lin in enumerate(linears):
            lin.weight.grad = rec[("M", li)][:, :-1].clone()
            lin.bias.grad = rec[("M", li)][:, -1].clone()
        opt.step()
    return out


# ---- deviations -------------------------------------------------------------------------------

GROUP = {"A": "factors", "G": "factors", "dA": "decomposition", "dG": "decomposition", "QA": "decomposition",
         "QG": "decomposition", "dgda": "decomposition", "Ainv": "decomposition", "Ginv": "decomposition",
         "V": "gradient", "nu": "gradient"}
GROUPS = ["factors", "decomposition", "gradient"]


def eigenvalues_of(rec, kind, li):
    """The eigenvalues that go with QA/QG: stored (dA/dG), or, with prediv, from the factor of
    the same step (only used to scale eigenvector differences)."""
    key = ("dA" if kind == "QA" else "dG", li)
    if key in rec:
        return rec[key]
    f = rec[("A" if kind == "QA" else "G", li)]
    return np.linalg.eigvalsh(f)


def deviation(kind, x, r, d=None):
    if kind in ("QA", "QG"):
        worst = 0.0
        for j in range(r.shape[1]):
            s = 1.0 if np.dot(x[:, j], r[:, j]) >= 0 else -1.0
            gap = min(abs(d[j] - d[k]) for k in range(len(d)) if k != j)
            worst = max(worst, float(np.max(np.abs(s * x[:, j] - r[:, j]))) * gap / float(np.max(np.abs(d))))
        return worst
    return float(np.max(np.abs(x - r)) / np.max(np.abs(r)))


def distance(ref, other, kinds=None):
    """Largest deviation per group over the records both runs have."""
    worst = {g: 0.0 for g in GROUPS}
    for rs, os_ in zip(ref, other):
        for (kind, li), r in rs.items():
            if kind not in GROUP or (kinds is not None and kind not in kinds) or (kind, li) not in os_:
                continue
            d = eigenvalues_of(rs, kind, li) if kind in ("QA", "QG") else None
            worst[GROUP[kind]] = max(worst[GROUP[kind]], deviation(kind, os_[(kind, li)], r, d))
    return worst


# ---- cases ------------------------------------------------------------------------------------

CASES = [
    # KFACPreconditioner's defaults apart from the numbers: eigen with the eigenvalue outer
    # product precomputed (compute_eigenvalue_outer_product=True).
    ("eigen_prediv", dict(method="eigen", prediv=1, factor_decay=0.9, factor_update_steps=1, inv_update_steps=1,
                          damping=0.003, kl_clip=0.01, lr=0.1)),
    ("eigen_freq", dict(method="eigen", prediv=0, factor_decay=0.8, factor_update_steps=2, inv_update_steps=4,
                        damping=0.01, kl_clip=0.003, lr=0.004)),
    ("inverse", dict(method="inverse", prediv=0, factor_decay=0.85, factor_update_steps=1, inv_update_steps=2,
                     damping=0.02, kl_clip=0.01, lr=0.1)),
]


def wrong_variants(opts):
    other = "inverse" if opts["method"] == "eigen" else "eigen"
    label = ("damping added to each factor (the inverse method)" if opts["method"] == "eigen"
             else "damping on the Kronecker product's eigenvalues (the eigen method)")
    return [
        (label, lambda: run(opts, torch.float64, method=other)),
        ("factors started from 0, not the identity", lambda: zero_run(opts)),
        ("g multiplied by the rows (grad_scaler 1/rows)", lambda: run(opts, torch.float64,
                                                                      grad_scaler=lambda: 1.0 / ROWS)),
        ("factor_decay swapped (d -> 1 - d)", lambda: run(opts, torch.float64, factor_decay=1 - opts["factor_decay"])),
        ("no KL clipping (kl_clip 1e30)", lambda: run(opts, torch.float64, kl_clip=1e30)),
    ]


def zero_run(opts):
    with factors_from_zero():
        return run(opts, torch.float64)


def fmt(a):
    return " ".join(repr(float(v)) for v in np.asarray(a).reshape(-1))


def main():
    os.makedirs(OUT, exist_ok=True)
    import importlib.metadata as md
    versions = peer_refs.versions(("kfac-pytorch", md.version("kfac_pytorch")), ("torch", torch.__version__),
                                  ("numpy", np.__version__))
    for name, opts in CASES:
        with float64_decompositions():
            ref = run(opts, torch.float64)
            wrong = [(label, distance(ref, f(), kinds={"A", "G", "V", "nu"})) for label, f in wrong_variants(opts)]
        f32 = distance(ref, run(opts, torch.float32))
        lines = peer_refs.header("K-FAC", __file__, versions) + [
            "case " + name,
            "source kfac.preconditioner.KFACPreconditioner(%s), float64 decompositions" % ", ".join(
                "%s=%r" % kv for kv in [
                    ("compute_method", opts["method"]), ("compute_eigenvalue_outer_product", bool(opts["prediv"])),
                    ("factor_decay", opts["factor_decay"]), ("factor_update_steps", opts["factor_update_steps"]),
                    ("inv_update_steps", opts["inv_update_steps"]), ("damping", opts["damping"]),
                    ("kl_clip", opts["kl_clip"]), ("lr", opts["lr"])]),
            "opt " + " ".join("%s=%r" % (k, v) for k, v in opts.items() if k != "method") + " method=" +
            opts["method"],
            "layers %d" % (len(SIZES) - 1)]
        for li in range(len(SIZES) - 1):
            lines.append("layer fc%d %d %d 1" % (li + 1, SIZES[li], SIZES[li + 1]))
        lines.append("steps %d rows %d" % (STEPS, ROWS))
        for g in GROUPS:
            lines.append("float32 %s %r" % (g, f32[g]))
        for label, d in wrong:
            for g in GROUPS:
                if d[g] > 0:
                    lines.append("sensitivity %s %r %s" % (g, d[g], label))
        for s, rec in enumerate(ref):
            lines.append("step %d" % (s + 1))
            for (kind, li), v in rec.items():
                lines.append("%s %d %d %s" % (kind, li, v.size, fmt(v)))
        lines.append("end")
        peer_refs.write_case(OUT, name, lines, report=False)
        nu = [rec[("nu", 0)][0] for rec in ref]
        print("%-13s float32 %s  nu %s" % (name, " ".join("%s %.2e" % (g, f32[g]) for g in GROUPS),
                                            " ".join("%.3f" % v for v in nu)))
        for label, d in wrong:
            print("    %-60s %s" % (label, " ".join("%s %.2e" % (g, d[g]) for g in GROUPS)))


if __name__ == "__main__":
    main()
