#!/usr/bin/env python3
"""References for bumblebee's policy loss head (bench/bench_policy_loss, skills/loss-policy.md).

Two jobs, on the GPU machine's torch:

1. Time and memory of other implementations of the same objective (GRPO / DAPO style: clipped
   ratio 0.2 / 0.28, k3 KL 0.01 to a reference, entropy 0.001, token mean) at V = 248320,
   H = 2048, bf16, T = 16K / 64K / 128K, rollouts of --seq tokens, one call = loss + backward:
     torch   plain PyTorch with materialised logits, torch.compile'd (the strongest plain form);
             torch_eager the same uncompiled
     liger   Liger-Kernel's LigerFusedLinearGRPOLoss (pure Python + Triton), from --liger-src
     verl    verl's fused linear log-prob + entropy kernel (Triton), from --verl-src, with the
             objective on its per-token outputs in PyTorch
   Prints one markdown row per (impl, T): median ms, peak GiB added by the call, or the error
   (OOM, or a kernel that refuses this Triton / GPU).

2. --check DIR: the parity of a dump written by `bench_policy_loss --dump DIR` (inputs, loss,
   d_h, d_w of bumblebee's head) against plain PyTorch in fp32 with materialised logits (the
   objective written from the formulas, autograd for the gradients); prints the relative errors.

    python3 bench/policy_loss_ref.py --impl torch,liger,verl --liger-src L/src --verl-src V
    python3 bench/policy_loss_ref.py --check /tmp/policy_dump
"""

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import torch

CLIP_LOW, CLIP_HIGH, KL, ENT = 0.2, 0.28, 0.01, 0.001


def objective(logits, targets, adv, old, ref, mask, temperature=1.0):
    """The policy objective from materialised logits [T, V] (token mean over mask)."""
    z = logits.float() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return loss_from_logp(logp, ent, adv, old, ref, mask)


def loss_from_logp(logp, ent, adv, old, ref, mask):
    lr = torch.clamp(logp - old, -20, 20)
    r = torch.exp(lr)
    pg = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    d = torch.clamp(ref - logp, -20, 20)
    kl = torch.exp(d) - d - 1
    per_token = pg + KL * kl - ENT * ent
    m = mask.float()
    return (per_token * m).sum() / m.sum()


def problem(T, V, H, seq, dev):
    g = torch.Generator(device="cpu").manual_seed(1)
    h = (torch.randn(T, H, generator=g)).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_()
    targets = ((torch.arange(T) * 7919) % V).to(dev)
    seqs = torch.arange(T) // seq
    adv_seq = ((torch.arange(T // seq + 1) % 3) - 1).float()
    adv = adv_seq[seqs].to(dev)
    old = (-12.4 + 0.1 * (((torch.arange(T) * 31) % 7) - 3)).float().to(dev)
    ref = (-12.4 + 0.05 * (((torch.arange(T) * 17) % 5) - 2)).float().to(dev)
    mask = torch.ones(T, dtype=torch.bool, device=dev)
    return h, w, targets, adv, old, ref, mask, adv_seq[: T // seq].to(dev)


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return ms[len(ms) // 2], (torch.cuda.max_memory_allocated() - base) / 2**30


def load_package(name, directory):
    """Imports DIRECTORY as package NAME without running its parents' __init__ (which may pull
    in a framework's whole dependency tree)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "__init__.py"),
                                                  submodule_search_locations=[directory])
    if not os.path.exists(os.path.join(directory, "__init__.py")):
        mod = types.ModuleType(name)
        mod.__path__ = [directory]
        sys.modules[name] = mod
        return mod
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_impl(name, args):
    if name in ("torch", "torch_eager"):
        # torch: compiled (the strongest plain form); torch_eager: the same without torch.compile,
        # for a torch / Triton pair whose compiler refuses the graph.
        f = torch.compile(objective) if name == "torch" else objective
        return lambda h, w, tg, adv, old, ref, mask, adv_seq: f(h @ w.t(), tg, adv, old, ref, mask)
    if name == "liger":
        sys.path.insert(0, args.liger_src)
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        loss = LigerFusedLinearGRPOLoss(beta=KL, use_ref_model=True, epsilon_low=CLIP_LOW, epsilon_high=CLIP_HIGH,
                                        loss_type="dapo", chunk_size=1)
        seq = args.seq

        def run(h, w, tg, adv, old, ref, mask, adv_seq):
            B = h.shape[0] // seq
            # Liger takes the hidden states as [batch, seq, H].
            out = loss(h.view(B, seq, h.shape[-1]), w, tg.view(B, seq), mask.view(B, seq), adv_seq,
                       ref_per_token_logps=ref.view(B, seq),
                       old_per_token_logps=old.view(B, seq))
            return out[0] if isinstance(out, tuple) else out
        return run
    if name == "verl":
        # kernels.py imports verl.utils.device; stand in empty parents so verl's own __init__ (its
        # whole dependency tree) does not run.
        for parent in ("verl", "verl.utils"):
            stub = types.ModuleType(parent)
            stub.__path__ = [os.path.join(args.verl_src, *parent.split("."))]
            sys.modules[parent] = stub
        load_package("bb_verl_kernel", os.path.join(args.verl_src, "verl", "utils", "kernel"))
        lce = importlib.import_module("bb_verl_kernel.linear_cross_entropy").linear_cross_entropy

        def run(h, w, tg, adv, old, ref, mask, adv_seq):
            try:
                a, e = lce(h, w, tg, 1.0, "none")  # newer: (hidden, weight, labels, temperature, reduction)
            except TypeError:
                a, e = lce(h, w, tg, "none")
            logp = -a if a.float().mean() > 0 else a  # some versions return -log p
            return loss_from_logp(logp.float(), e.float(), adv, old, ref, mask)
        return run
    raise SystemExit("unknown --impl %s (torch, torch_eager, liger, verl)" % name)


def bench(args):
    dev = torch.device("cuda")
    print("policy_loss_ref: V %d, H %d, bf16, rollouts of %d tokens, median of %d, torch %s, %s" % (
        args.vocab, args.hidden, args.seq, args.iters, torch.__version__, torch.cuda.get_device_name()))
    print("| impl | T | ms | peak GiB added | loss |")
    print("|---|---:|---:|---:|---:|")
    for name in args.impl.split(","):
        try:
            impl = make_impl(name, args)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print("| %s | - | - | - | cannot load: %s |" % (name, str(e).splitlines()[0][:120]), flush=True)
            continue
        for T in [int(x) for x in args.tokens.split(",")]:
            try:
                h, w, tg, adv, old, ref, mask, adv_seq = problem(T, args.vocab, args.hidden, args.seq, dev)
                out = {}

                def call():
                    h.grad = w.grad = None
                    loss = impl(h, w, tg, adv, old, ref, mask, adv_seq)
                    loss.backward()
                    out["loss"] = float(loss.detach())
                ms, gib = timed(call, args.iters)
                print("| %s | %dK | %.2f | %.2f | %.6f |" % (name, T // 1024, ms, gib, out["loss"]), flush=True)
            except Exception as e:  # noqa: BLE001 - OOM and refusals are results
                print("| %s | %dK | - | - | %s |" % (name, T // 1024, str(e).splitlines()[0][:120]), flush=True)
            finally:
                h = w = None
                torch.cuda.empty_cache()


def check(directory):
    meta = json.load(open(os.path.join(directory, "meta.json")))
    T, V, H = meta["T"], meta["V"], meta["H"]

    def load(name, shape, dtype=torch.float32):
        return torch.from_numpy(__import__("numpy").fromfile(os.path.join(directory, name + ".bin"),
                                                             dtype="float32" if dtype == torch.float32 else "int32")).view(*shape)
    h = load("h", (T, H)).double().requires_grad_()
    w = load("w", (V, H)).double().requires_grad_()
    tg = load("targets", (T,), torch.int32).long()
    adv, old, ref = load("adv", (T,)).double(), load("old", (T,)).double(), load("ref", (T,)).double()
    mask = tg >= 0
    loss = objective(h @ w.t(), tg, adv, old, ref, mask).double()
    loss.backward()
    got_loss = meta["loss"]
    d_h, d_w = load("d_h", (T, H)).double(), load("d_w", (V, H)).double()

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    print("parity of %s (T %d, V %d, H %d, %s operands) against PyTorch fp64 with materialised logits:" % (
        directory, T, V, H, meta["dtype"]))
    print("| quantity | relative error |")
    print("|---|---:|")
    loss = float(loss.detach())
    print("| loss | %.3e |" % (abs(got_loss - loss) / abs(loss)))
    print("| d_h | %.3e |" % rel(d_h, h.grad))
    print("| d_w | %.3e |" % rel(d_w, w.grad))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="torch")
    ap.add_argument("--tokens", default="16384,65536,131072")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--liger-src", default="")
    ap.add_argument("--verl-src", default="")
    ap.add_argument("--check", default="", help="a dump of bench_policy_loss --dump DIR")
    args = ap.parse_args()
    if args.check:
        check(args.check)
    else:
        bench(args)


if __name__ == "__main__":
    main()
