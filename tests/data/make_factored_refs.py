#!/usr/bin/env python3
"""Reference vectors for gradapt's factored optimizers (Adafactor, SM3), from optax and PyTorch.

Usage (not run by CI; the outputs under tests/data/optim_factored/ are committed):

    python3 -m venv /tmp/refs-af && /tmp/refs-af/bin/pip install jax optax torch
    /tmp/refs-af/bin/python tests/data/make_factored_refs.py   # writes tests/data/optim_factored/*.txt

The conventions are those of make_optim_refs.py (imported, not repeated): the counter-based
input generator the C++ test reproduces bit for bit, the stored samples, sums and sums of
squares after the first and the last step, the movement scale differences are measured in,
and the "sensitivity" of each case (how far deliberately wrong variants land, in that unit).
The "opt" line lists gradapt::adafactor_options / gradapt::sm3_options as key=value pairs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_optim_refs as base  # noqa: E402  (sets JAX_PLATFORMS=cpu before importing jax)
from make_optim_refs import T, run_optax, run_torch  # noqa: E402
import peer_refs  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_factored")
STEPS = 6


def factored_tensors(torch_ok=False):
    ts = [
        T("bias", [37], 11, 12),
        T("small", [16, 24], 21, 22),  # below min_dim_size_to_factor: a full second moment
        T("big", [515, 257], 31, 32),  # large 2-D, factored (> 128 Ki elements: parallel paths)
        T("wide", [130, 300], 33, 34),  # factored, the column axis is the largest
        T("square", [128, 128], 35, 36),  # equal dims (ties go to the later axis)
        T("cube", [3, 140, 129], 41, 42, glog=-1),  # 3-D, adjacent factored axes
        T("apart", [150, 2, 130], 43, 44),  # 3-D, factored axes 0 and 2
        T("four", [129, 2, 131, 3], 45, 46),  # rank 4
        T("col", [1, 300, 1], 51, 52),  # size-1 dims
        T("scalar", [], 61, 62),  # rank 0
        T("zero_w", [130, 128], 81, 82, zero_p=True),
        T("zero_g", [16], 91, 92, zero_g=True),
        T("zero_g2", [128, 130], 93, 94, zero_g=True),
        T("denorm", [24], 101, 102, glog=-126),  # subnormal float32 gradients
    ]
    if not torch_ok:  # torch.optim.Adafactor divides by numel: no empty tensors there
        ts.insert(10, T("empty", [0, 200], 71, 72))
    return ts


def nonfinite_tensors():
    return [
        T("ok", [40], 11, 12),
        T("ok2", [130, 140], 13, 14),
        T("nan_g", [33], 21, 22, inject=[(2, 3, float("nan"))]),
        T("inf_g", [17], 31, 32, inject=[(1, 0, float("inf"))]),
        T("inf_f", [129, 131], 33, 34, inject=[(3, 700, float("-inf"))]),
    ]


def af_line(lr=1.0, relative_step=0, decay_rate=0.8, min_dim=128, factored=1, axes=0, eps1=1e-30,
            eps1_clamp=0, clip=1.0, param_scale=1, eps2=1e-3, momentum=0.0, wd=0.0, wd_times_lr=0):
    return ("adafactor lr=%r relative_step=%d decay_rate=%r min_dim=%d factored=%d axes=%d eps1=%r "
            "eps1_clamp=%d clip=%r param_scale=%d eps2=%r momentum=%r wd=%r wd_times_lr=%d" % (
                lr, relative_step, decay_rate, min_dim, factored, axes, eps1, eps1_clamp, clip, param_scale,
                eps2, momentum, wd, wd_times_lr))


def torch_line(lr=0.01, eps1=None, eps2=1e-3, d=1.0, beta2_decay=-0.8, wd=0.0):
    e1 = float(np.finfo(np.float32).eps) if eps1 is None else eps1
    return af_line(lr=lr, relative_step=1, decay_rate=-beta2_decay, min_dim=0, axes=1, eps1=e1, eps1_clamp=1,
                   clip=d, eps2=eps2, wd=wd, wd_times_lr=1)


def sm3_line(lr=0.1, momentum=0.9, eps=1e-8):
    return "sm3 lr=%r momentum=%r eps=%r" % (lr, momentum, eps)


def torch_af(ts, **kw):
    return run_torch(lambda ps: torch.optim.Adafactor(list(ps.values()), foreach=False, **kw), ts, STEPS)


def cases():
    out = []
    std = factored_tensors()
    tstd = factored_tensors(torch_ok=True)
    nf = nonfinite_tensors()

    def add(name, source, opt, tensors, run, wrong):
        out.append((name, source, opt, tensors, run, wrong))

    def af(ts, **kw):
        return run_optax(optax.adafactor(**kw), ts, STEPS)

    # Adafactor, optax ---------------------------------------------------------------------------
    add("adafactor_optax_default", "optax.adafactor()  (learning_rate=None: no lr scaling)", af_line(), std,
        lambda ts: af(ts),
        [("decay_rate 0.7", lambda ts: af(ts, decay_rate=0.7)),
         ("no clipping", lambda ts: af(ts, clipping_threshold=None)),
         ("not factored", lambda ts: af(ts, factored=False))])
    add("adafactor_optax_momentum", "optax.adafactor(0.05, momentum=0.9, weight_decay_rate=1e-3)",
        af_line(lr=0.05, momentum=0.9, wd=1e-3), std,
        lambda ts: af(ts, learning_rate=0.05, momentum=0.9, weight_decay_rate=1e-3),
        [("momentum 0.8", lambda ts: af(ts, learning_rate=0.05, momentum=0.8, weight_decay_rate=1e-3)),
         ("no weight decay", lambda ts: af(ts, learning_rate=0.05, momentum=0.9)),
         ("no parameter scale", lambda ts: af(ts, learning_rate=0.05, momentum=0.9, weight_decay_rate=1e-3,
                                              multiply_by_parameter_scale=False))])
    add("adafactor_optax_options",
        "optax.adafactor(0.02, min_dim_size_to_factor=16, clipping_threshold=0.5, decay_rate=0.6, "
        "multiply_by_parameter_scale=False)",
        af_line(lr=0.02, min_dim=16, clip=0.5, decay_rate=0.6, param_scale=0), std,
        lambda ts: af(ts, learning_rate=0.02, min_dim_size_to_factor=16, clipping_threshold=0.5, decay_rate=0.6,
                      multiply_by_parameter_scale=False),
        [("min dim 128", lambda ts: af(ts, learning_rate=0.02, clipping_threshold=0.5, decay_rate=0.6,
                                       multiply_by_parameter_scale=False)),
         ("clipping 0.55", lambda ts: af(ts, learning_rate=0.02, min_dim_size_to_factor=16,
                                         clipping_threshold=0.55, decay_rate=0.6,
                                         multiply_by_parameter_scale=False)),
         ("decay 0.65", lambda ts: af(ts, learning_rate=0.02, min_dim_size_to_factor=16, clipping_threshold=0.5,
                                      decay_rate=0.65, multiply_by_parameter_scale=False))])
    add("adafactor_optax_unfactored", "optax.adafactor(0.02, factored=False, eps=1e-20)",
        af_line(lr=0.02, factored=0, eps1=1e-20), std,
        lambda ts: af(ts, learning_rate=0.02, factored=False, eps=1e-20),
        [("factored", lambda ts: af(ts, learning_rate=0.02, eps=1e-20)),
         ("lr 0.021", lambda ts: af(ts, learning_rate=0.021, factored=False, eps=1e-20)),
         ("no clipping", lambda ts: af(ts, learning_rate=0.02, factored=False, eps=1e-20,
                                       clipping_threshold=None))])
    add("adafactor_nonfinite_optax", "optax.adafactor(0.01) with inf/NaN gradients injected",
        af_line(lr=0.01), nf, lambda ts: af(ts, learning_rate=0.01), [])

    # Adafactor, torch.optim.Adafactor -----------------------------------------------------------
    add("adafactor_torch", "torch.optim.Adafactor(lr=0.01, foreach=False)", torch_line(), tstd,
        lambda ts: torch_af(ts, lr=0.01),
        [("lr 0.0105", lambda ts: torch_af(ts, lr=0.0105)),
         ("beta2_decay -0.7", lambda ts: torch_af(ts, lr=0.01, beta2_decay=-0.7)),
         ("d 2", lambda ts: torch_af(ts, lr=0.01, d=2.0))])
    add("adafactor_torch_wd", "torch.optim.Adafactor(lr=0.05, weight_decay=0.1, eps=(1e-6, 1e-2), d=1.5, "
        "beta2_decay=-0.6, foreach=False)",
        torch_line(lr=0.05, eps1=1e-6, eps2=1e-2, d=1.5, beta2_decay=-0.6, wd=0.1), tstd,
        lambda ts: torch_af(ts, lr=0.05, weight_decay=0.1, eps=(1e-6, 1e-2), d=1.5, beta2_decay=-0.6),
        [("no weight decay", lambda ts: torch_af(ts, lr=0.05, eps=(1e-6, 1e-2), d=1.5, beta2_decay=-0.6)),
         ("eps2 1e-3", lambda ts: torch_af(ts, lr=0.05, weight_decay=0.1, eps=(1e-6, 1e-3), d=1.5,
                                           beta2_decay=-0.6)),
         ("d 1", lambda ts: torch_af(ts, lr=0.05, weight_decay=0.1, eps=(1e-6, 1e-2), beta2_decay=-0.6))])

    # SM3, optax ---------------------------------------------------------------------------------
    def sm3(ts, lr, **kw):
        return run_optax(optax.sm3(lr, **kw), ts, STEPS)

    # optax.sm3 fails on rank-0 tensors (no covers) and on empty ones (max of nothing): left out
    # here, gradapt's own behaviour for them is tested in tests/test_optim_sm3.cpp.
    sm3_std = [t for t in std if t.name not in ("scalar", "empty")]

    add("sm3_optax", "optax.sm3(0.1)  (momentum 0.9)", sm3_line(lr=0.1), sm3_std,
        lambda ts: sm3(ts, 0.1),
        [("momentum 0.8", lambda ts: sm3(ts, 0.1, momentum=0.8)),
         ("lr 0.105", lambda ts: sm3(ts, 0.105)),
         ("adagrad (no covers)", lambda ts: run_optax(optax.chain(
             optax.scale_by_rss(initial_accumulator_value=0.0, eps=1e-8), optax.ema(0.9, debias=False),
             optax.scale(-0.1)), ts, STEPS))])
    add("sm3_optax_nomomentum", "optax.sm3(0.05, momentum=0.0)", sm3_line(lr=0.05, momentum=0.0), sm3_std,
        lambda ts: sm3(ts, 0.05, momentum=0.0),
        [("momentum 0.1", lambda ts: sm3(ts, 0.05, momentum=0.1)),
         ("lr 0.0525", lambda ts: sm3(ts, 0.0525, momentum=0.0)),
         ("momentum 0.9", lambda ts: sm3(ts, 0.05))])
    add("sm3_nonfinite_optax", "optax.sm3(0.1) with inf/NaN gradients injected", sm3_line(lr=0.1), nf,
        lambda ts: sm3(ts, 0.1), [])
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    versions = peer_refs.versions(("numpy", np.__version__), ("jax", jax.__version__), ("optax", optax.__version__),
                                  ("torch", torch.__version__))
    only = set(sys.argv[1:])
    for name, source, opt, tensors, run, wrong in cases():
        if only and name not in only:
            continue
        lines = base.case_lines("factored-optimizer", __file__, versions, name, source, opt, tensors, run(tensors),
                                wrong)
        peer_refs.write_case(OUT, name, lines)


if __name__ == "__main__":
    main()
