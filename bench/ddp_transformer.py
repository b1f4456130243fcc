#!/usr/bin/python3
"""The peer of examples/torch_transformer.cpp in PyTorch: the same decoder-only character-level
transformer, initial weights, corpus, batch order, seeds and hyperparameters, trained with
torch.nn.parallel.DistributedDataParallel over gloo and torch.optim.AdamW, one process per rank
(torch.multiprocessing), torch.set_num_threads(1).

Run it with Debian's python3-torch (1.13.1, /usr/bin/python3): it loads the same libtorch_cpu as
the LibTorch example, so the forward and backward kernels are the same.

    /usr/bin/python3 bench/ddp_transformer.py --ranks 2 --steps 200 --csv out.csv

Prints the same summary as the C++ program: mean step time (forward + backward + optimizer step
over the steps after the warm-up, each step's time taken on its slowest rank), optimizer-state
bytes per rank (the tensors in optimizer.state), the final loss (mean over ranks, last 10 steps)
and whether the replicas hold bitwise identical parameters. The CSV holds step, loss (mean over
ranks), step time (max over ranks).
"""
import argparse
import hashlib
import inspect
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


class SplitMix64:
    """splitmix64, the generator examples/torch_transformer.cpp uses."""

    def __init__(self, seed):
        self.s = seed & MASK64

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def make_corpus(chars):
    """The corpus of the C++ program (make_corpus there), byte for byte."""
    rng = SplitMix64(12345)
    n_words = 200
    words = []
    for _ in range(n_words):
        length = 2 + rng.next() % 6
        words.append("".join(chr(ord("a") + rng.next() % 26) for _ in range(length)))
    parts, size = [], 0
    w, sentences = rng.next() % n_words, 0
    while size < chars:
        length = 4 + rng.next() % 9
        for i in range(length):
            word = words[w]
            if i == 0:
                word = word[0].upper() + word[1:]
            piece = word + (". " if i + 1 == length else " ")
            parts.append(piece)
            size += len(piece)
            w = (31 * w + 7 + rng.next() % 8) % n_words
        sentences += 1
        if sentences % 5 == 0:
            parts.append("\n")
            size += 1
    return "".join(parts)[:chars].encode("ascii")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        B, T, C = x.shape
        hd = C // self.heads
        h = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        q, k, v = h[0], h[1], h[2]
        att = q.matmul(k.transpose(-2, -1)).mul(1.0 / math.sqrt(hd))
        att = att.masked_fill(mask, -math.inf).softmax(-1)
        y = att.matmul(v).transpose(1, 2).reshape(B, T, C)
        x1 = x + self.proj(y)
        return x1 + self.out(F.gelu(self.fc(self.ln2(x1))))


class Transformer(nn.Module):
    def __init__(self, o):
        super().__init__()
        self.tok = nn.Embedding(256, o.d_model)
        self.pos = nn.Embedding(o.context, o.d_model)
        self.blocks = nn.ModuleList([Block(o.d_model, o.heads) for _ in range(o.layers)])
        self.ln_f = nn.LayerNorm(o.d_model)
        self.head = nn.Linear(o.d_model, 256, bias=False)
        self.mask = torch.ones(o.context, o.context, dtype=torch.bool).triu(1)  # not a buffer

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, dtype=torch.long))
        m = self.mask[:T, :T]
        for b in self.blocks:
            x = b(x, m)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def init(self, seed):
        torch.manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def adamw_kind():
    """fused=True where torch.optim.AdamW has it for CPU tensors, else foreach=True."""
    params = inspect.signature(torch.optim.AdamW).parameters
    if "fused" in params and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4):
        return "fused"
    return "foreach"


def worker(rank, o, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=o.ranks)
    world = o.ranks
    corpus = torch.frombuffer(bytearray(make_corpus(300000)), dtype=torch.uint8).to(torch.long)
    model = Transformer(o)
    model.init(o.init_seed)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    kind = adamw_kind()
    opt = torch.optim.AdamW(ddp.parameters(), lr=o.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=o.weight_decay, **{kind: True})

    n = corpus.numel() - o.context - 1
    data = SplitMix64(o.data_seed)
    ar = torch.arange(o.context + 1)
    losses = torch.zeros(o.steps, dtype=torch.float64)
    times = torch.zeros(o.steps, dtype=torch.float64)
    parts = torch.zeros(3, dtype=torch.float64)  # forward, backward, optimizer step: mean seconds
    for t in range(o.steps):
        offs = []
        for r in range(world):
            for _ in range(o.batch):
                off = data.next() % n
                if r == rank:
                    offs.append(off)
        win = corpus[torch.tensor(offs).unsqueeze(1) + ar]
        x, y = win[:, :-1].contiguous(), win[:, 1:].contiguous()
        lr = o.lr * min(1.0, (t + 1) / o.warmup_lr)
        for g in opt.param_groups:
            g["lr"] = lr

        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits = ddp(x)
        loss = F.cross_entropy(logits.view(-1, 256), y.view(-1))
        t1 = time.perf_counter()
        loss.backward()  # DDP's reducer allreduces the buckets and waits for them here
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        times[t] = t3 - t0
        if t >= o.warmup:
            parts += torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64) / (o.steps - o.warmup)
        losses[t] = loss.item()

    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(parts, op=dist.ReduceOp.MAX)
    losses /= world
    mean_step = times[o.warmup:].mean().item()
    final_loss = losses[-min(10, o.steps):].mean().item()

    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if torch.is_tensor(v))
    b = torch.tensor([float(state_bytes)], dtype=torch.float64)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    h = int.from_bytes(digest.digest()[:6], "little")  # 48 bits: exact in a double
    hs = torch.tensor([float(h), -float(h)], dtype=torch.float64)
    dist.all_reduce(hs, op=dist.ReduceOp.MAX)
    identical = hs[0].item() == -hs[1].item()

    if rank == 0:
        if o.csv:
            with open(o.csv, "w") as f:
                f.write("step,loss,step_seconds\n")
                for i in range(o.steps):
                    f.write(f"{i + 1},{losses[i].item():.6f},{times[i].item():.6f}\n")
        print(f"ddp_transformer: {world} ranks x {o.batch} sequences of {o.context} bytes, {n_params} parameters "
              f"in {len(list(model.parameters()))} tensors (torch {torch.__version__})")
        print(f"ddp_transformer: PyTorch DDP (gloo, gradient_as_bucket_view) + torch.optim.AdamW({kind}=True), "
              f"{o.steps} steps")
        print(f"mean step time: {1e3 * mean_step:.2f} ms (steps {o.warmup + 1}..{o.steps}, forward + backward + "
              f"step, each step's slowest rank)")
        print(f"breakdown: forward {1e3 * parts[0]:.2f} ms, backward {1e3 * parts[1]:.2f} ms (allreduce in DDP's "
              f"hooks and its wait), optimizer.step() {1e3 * parts[2]:.2f} ms (each the slowest rank's mean)")
        print(f"optimizer state bytes per rank: {int(b.item())} (largest rank), {state_bytes} (rank 0)")
        print(f"final loss: {final_loss:.4f} (mean over ranks, last 10 steps; 0 skipped steps)")
        print(f"replicas bitwise identical: {'yes' if identical else 'no'}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the mean step time")
    ap.add_argument("--warmup-lr", type=int, default=20, help="steps of linear learning-rate warm-up")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--init-seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--csv", default="")
    o = ap.parse_args()
    if o.steps <= o.warmup:
        ap.error(f"--steps {o.steps} must exceed --warmup {o.warmup}")
    mp.spawn(worker, args=(o, o.port), nprocs=o.ranks, join=True)


if __name__ == "__main__":
    main()
