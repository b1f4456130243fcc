#!/usr/bin/env python3
"""Writes the peer-implementation reference vectors under tests/data/loss_scaler/ that
tests/test_loss_scaler.cpp and tests/test_clip.cpp compare gradapt against.

Peers (run here, on the CPU; nothing of their code is copied into gradapt):
  - PyTorch torch.amp.GradScaler("cpu"): the scale sequence over scripted overflow patterns
    (scale and growth tracker after every update, and whether the optimizer stepped);
  - PyTorch torch._amp_foreach_non_finite_check_and_unscale_: the fused unscale + check on
    float32 / float16 / bfloat16 gradients (input and output bits, found_inf), with
    inv_scale = float(1 / double(scale)) exactly as GradScaler computes it;
  - PyTorch torch.nn.utils.clip_grad_norm_: total norm and clipped gradients (float32 and
    float64 lists);
  - DeepSpeed deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler: the hysteresis
    (delayed_shift) semantics, per step, and the step at which it refuses to go below
    min_scale.

Every floating-point number is written exactly: scales as Python float.hex(), tensor elements
as the hexadecimal bits of their storage type. CI never runs this script; its outputs are
committed.

    python3 -m venv venv && venv/bin/pip install torch deepspeed
    venv/bin/python tests/data/make_loss_scaler_refs.py      (from the repository root)
"""
import os
import random
import struct
import types

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_scaler")


def bits(t):
    """Hex bits of every element of a 1-D tensor, in its storage type."""
    if t.dtype == torch.float32:
        return ["%08x" % (v & 0xFFFFFFFF) for v in t.view(torch.int32).tolist()]
    if t.dtype == torch.float64:
        return ["%016x" % (v & 0xFFFFFFFFFFFFFFFF) for v in t.view(torch.int64).tolist()]
    return ["%04x" % (v & 0xFFFF) for v in t.view(torch.int16).tolist()]


class CountingSGD(torch.optim.SGD):
    """SGD that counts the step() calls GradScaler lets through."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def torch_scale_sequence(f, name, init, growth, backoff, interval, max_scale, pattern):
    """GradScaler over `pattern` (True = the step's gradient holds an inf or NaN)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth,
                                  backoff_factor=backoff, growth_interval=interval)
    p = torch.nn.Parameter(torch.zeros(5))
    opt = CountingSGD([p])
    f.write("config %s %s %s %s %d %s %d\n" % (name, float(init).hex(), float(growth).hex(),
                                             float(backoff).hex(), interval, float(max_scale).hex(),
                                             len(pattern)))
    for i, bad in enumerate(pattern):
        s = float(scaler.scale(torch.tensor(1.0)))  # the scaled "loss" of this step: S
        g = torch.full((5,), 0.25 * s, dtype=torch.float32)
        if bad:
            g[i % 5] = float("nan") if i % 3 == 0 else float("inf")
        p.grad = g
        before = opt.calls
        scaler.step(opt)
        scaler.update()
        f.write("step %d %d %d %s %d\n" % (i, int(bad), opt.calls - before, float(scaler.get_scale()).hex(),
                                          int(scaler._get_growth_tracker())))


def write_scale_sequences():
    rng = random.Random(20240611)
    with open(os.path.join(OUT, "torch_scale.txt"), "w") as f:
        # 1. Defaults with a short growth interval: isolated and consecutive overflows, growths.
        bad = {0, 1, 5, 9, 10, 11, 20, 30, 31, 45, 60, 61, 62, 63, 70}
        torch_scale_sequence(f, "pow2", 65536.0, 2.0, 0.5, 3, 3.4028234663852886e38,
                             [i in bad for i in range(80)])
        # 2. Factors that are not powers of two: every update rounds to float32.
        torch_scale_sequence(f, "nonpow2", 1000.0, 1.7, 0.35, 2, 3.4028234663852886e38,
                             [rng.random() < 0.3 for _ in range(60)])
        # 3. Growth to the top of float32: PyTorch keeps 2^127 (2^128 is inf); gradapt caps
        #    at max_scale = 2^127.
        torch_scale_sequence(f, "cap", 2.0 ** 120, 2.0, 0.5, 1, 2.0 ** 127, [False] * 12)
        # 4. Growth interval 1 with a random pattern.
        torch_scale_sequence(f, "interval1", 2.0 ** 10, 2.0, 0.5, 1, 3.4028234663852886e38,
                             [rng.random() < 0.45 for _ in range(50)])


def deepspeed_sequence(f, name, init, window, min_scale, hysteresis, consecutive, pattern, compare_all):
    from deepspeed.runtime.fp16 import loss_scaler as ls
    ls.dist = types.SimpleNamespace(get_rank=lambda: 0)  # no process group: rank 0 logs
    sc = ls.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=min_scale,
                              delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    assert sc.scale_factor == 2.0
    rows = []
    for i, bad in enumerate(pattern):
        try:
            sc.update_scale(bad)
        except Exception:  # DeepSpeed raises at min_scale
            rows.append((i, bad, sc.cur_scale, sc.cur_hysteresis, 1, 1))
            break
        rows.append((i, bad, sc.cur_scale, sc.cur_hysteresis, 0, 0))
    # Comparable steps: every step when no growth can occur; otherwise overflow steps and the
    # last clean step of each clean run (DeepSpeed 0.19 grows on the (w+1)-th clean step of a
    # run, gradapt and PyTorch on the w-th; runs of w+1 .. 2w-1 clean steps grow once in both).
    out = []
    for k, (i, bad, s, h, raised, _) in enumerate(rows):
        last_of_run = (not bad) and (k + 1 == len(rows) or rows[k + 1][1])
        cmp = 1 if (compare_all or bad or raised or last_of_run) else 0
        out.append("step %d %d %s %d %d %d\n" % (i, int(bad), float(s).hex(), h, raised, cmp))
    f.write("config %s %s %d %s %d %d %d\n" % (name, float(init).hex(), window, float(min_scale).hex(),
                                             hysteresis, int(consecutive), len(out)))
    f.writelines(out)


def runs(lengths, overflow_runs):
    """Clean runs of the given lengths separated by runs of overflows."""
    pattern = []
    for n, o in zip(lengths, overflow_runs):
        pattern += [False] * n + [True] * o
    return pattern


def write_hysteresis():
    import deepspeed
    with open(os.path.join(OUT, "deepspeed_hysteresis.txt"), "w") as f:
        f.write("# deepspeed %s\n" % deepspeed.__version__)
        # H = 2, refilled only on growth (none here: window 1000): one tolerated overflow, then
        # every overflow backs off until min_scale = 1, where DeepSpeed raises.
        deepspeed_sequence(f, "h2", 2.0 ** 8, 1000, 1.0, 2, False,
                           runs([3, 2, 1, 4, 0, 2, 1, 0, 0, 0], [1, 1, 2, 1, 1, 1, 1, 1, 1, 3]), True)
        # H = 3, refilled on every clean step: only 3 overflows in a row back off.
        deepspeed_sequence(f, "h3_consecutive", 2.0 ** 12, 1000, 1.0, 3, True,
                           runs([2, 1, 3, 1, 2, 1, 1, 5], [2, 3, 1, 4, 2, 5, 1, 2]), True)
        # H = 2 with growth (window 4) and refills on growth: clean runs of 5..7 steps.
        deepspeed_sequence(f, "h2_growth", 2.0 ** 10, 4, 1.0, 2, False,
                           runs([5, 6, 7, 5, 6, 5, 7], [1, 1, 2, 3, 1, 2, 1]), False)
        # H = 4, refilled on every clean step, with growth (window 3): runs of 4..5 steps.
        deepspeed_sequence(f, "h4_consecutive_growth", 2.0 ** 6, 3, 1.0, 4, True,
                           runs([4, 5, 4, 5, 4], [3, 4, 5, 2, 6]), False)


def special_values(dtype):
    info = torch.finfo(dtype)
    return [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny,
            info.tiny * 0.5, info.smallest_normal * 2 ** -3, 1.0, -1.0]


def random_grads(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(torch.tensor(10.0, dtype=torch.float64),
                    torch.empty(n, dtype=torch.float64).uniform_(-9, 5, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    v = (mag * sign).to(dtype)
    specials = special_values(dtype)
    for k, s in enumerate(specials):  # first element, last element, and spread in between
        pos = [0, n - 1][k] if k < 2 else (k * 97) % n
        v[pos] = s
    return v


def write_unscale():
    for dtype, name in [(torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")]:
        for scale, tag in [(3000.0, "s3000"), (65536.0, "s65536"), (3.0517578125e-05 * 7, "small")]:
            x = random_grads(dtype, 1000, 7 + len(tag))
            inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
            y = x.clone()
            found = torch.zeros(1, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_([y], found, inv)
            path = os.path.join(OUT, "torch_unscale_%s_%s.txt" % (name, tag))
            with open(path, "w") as f:
                f.write("scale %s inv %08x found_inf %d n %d\n" % (
                    float(torch.tensor(scale, dtype=torch.float32)).hex(),
                    struct.unpack("<I", struct.pack("<f", float(inv)))[0], int(found.item()), x.numel()))
                for a, b in zip(bits(x), bits(y)):
                    f.write("%s %s\n" % (a, b))
    # 16-bit gradients unscaled into float32 master gradients: master = float(g) * inv.
    for dtype, name in [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")]:
        scale = 3000.0
        x = random_grads(dtype, 1000, 99)
        inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
        m = x.float()
        found = torch.zeros(1, dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_([m], found, inv)
        with open(os.path.join(OUT, "torch_unscale_master_%s.txt" % name), "w") as f:
            f.write("scale %s inv %08x found_inf %d n %d\n" % (
                float(scale).hex(), struct.unpack("<I", struct.pack("<f", float(inv)))[0],
                int(found.item()), x.numel()))
            for a, b in zip(bits(x), bits(m)):
                f.write("%s %s\n" % (a, b))


def write_clip():
    shapes = [(3, 5), (17,), (2, 3, 4), (1,), (0,), (20, 15)]
    g = torch.Generator().manual_seed(5)
    with open(os.path.join(OUT, "torch_clip.txt"), "w") as f:
        for dtype, name in [(torch.float32, "float32"), (torch.float64, "float64")]:
            base = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) * 0.3 for s in shapes]
            norm0 = float(torch.linalg.vector_norm(torch.cat([b.reshape(-1).double() for b in base])))
            cases = [("clip", 0.25 * norm0), ("noclip", 4.0 * norm0), ("zero_max", 0.0),
                     ("near", norm0 * (1 - 2e-7))]
            for cname, max_norm in cases:
                ts = [b.clone().requires_grad_(True) for b in base]
                for t, b in zip(ts, base):
                    t.grad = b.clone()
                total = torch.nn.utils.clip_grad_norm_(ts, max_norm)
                f.write("case %s_%s %s %s %d %s\n" % (cname, name, name, float(max_norm).hex(), len(ts),
                                                       float(total).hex()))
                for t, b in zip(ts, base):
                    ins, outs = bits(b.reshape(-1)), bits(t.grad.reshape(-1))
                    f.write("tensor %d\n" % len(ins))
                    for a, c in zip(ins, outs):
                        f.write("%s %s\n" % (a, c))
            # All-zero gradients: the norm is 0 and nothing changes.
            ts = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
            for t in ts:
                t.grad = torch.zeros_like(t)
            total = torch.nn.utils.clip_grad_norm_(ts, 1.0)
            f.write("case zero_grad_%s %s %s %d %s\n" % (name, name, float(1.0).hex(), len(ts), float(total).hex()))
            for t in ts:
                ins = bits(t.grad.reshape(-1))
                f.write("tensor %d\n" % len(ins))
                for a in ins:
                    f.write("%s %s\n" % (a, a))


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    write_scale_sequences()
    write_hysteresis()
    write_unscale()
    write_clip()
    print("torch", torch.__version__, "- wrote", sorted(os.listdir(OUT)))
