#!/usr/bin/env python3
"""Reference: a straightforward PyTorch + Hugging Face training step of the same model slice.

Builds the model of a config.json (Qwen3MoeForCausalLM, or Qwen3_5MoeForCausalLM for a
qwen3_5_moe_text / qwen3_5_moe config; random init, bf16, on one GPU) with SDPA attention and
grouped-GEMM experts where transformers has them, and times forward + backward + AdamW steps on
one sequence of S tokens. Prints a table like bench_train_step (tokens/s, model TFLOP/s, peak
GiB).

Qwen3.5's Gated DeltaNet layers run transformers' PyTorch fallback (torch_chunk_gated_delta_rule
and the conv1d fallback) unless flash-linear-attention / causal-conv1d are installed; the script
prints which one ran.

    python3 bench/hf_train_step.py --config configs/models/qwen3-30b-a3b-4layer/config.json \\
        --seq 8192,16384,32768,65536 --steps 5 --warmup 2 [--compile] [--no-checkpointing]

  --compile           torch.compile each decoder layer (the usual way to compile an HF model
                      for training; the embedding, head and loss stay eager)
  --no-checkpointing  keep every activation (no gradient checkpointing): faster, more memory
  --grad-clip X       clip the gradient norm to X before the update
                      (torch.nn.utils.clip_grad_norm_, foreach); 0 (default) = no clipping,
                      like bumblebee's train.grad_clip = 0
  --fsdp              launched by torchrun: one process per GPU, PyTorch FSDP2
                      (torch.distributed.fsdp.fully_shard on every decoder layer, then on the
                      root), each rank training on its own sequence of S tokens; reports
                      tokens/s and model TFLOP/s per GPU (slowest rank's median step) and the
                      largest per-rank peak. No expert parallelism: every rank runs every
                      expert on its own tokens (bumblebee's EP rows are not comparable 1:1).

    torchrun --nproc_per_node 8 bench/hf_train_step.py --fsdp \\
        --config configs/models/qwen3-30b-a3b-4layer/config.json --seq 16384
"""
import argparse
import json
import os
import statistics
import time

import torch


def text_config(cfg):
    """The text part of a config.json: itself, or its nested text_config (qwen3_5_moe)."""
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def layer_types(cfg):
    L = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("model_type", "").startswith("qwen3_5_moe"):
        k = cfg.get("full_attention_interval", 4)
        return ["linear_attention" if (i + 1) % k else "full_attention" for i in range(L)]
    return ["full_attention"] * L


def model_flops(cfg, s):
    """Model FLOPs of one training step (3 x forward) on one sequence of s tokens, as bumblebee
    counts them (skills/model-config.md): 2 x active matmul parameters per token, plus for
    full-attention layers 2 x 2 x (s^2 / 2) x heads x head_dim (causal QK^T and PV), plus for
    Gated DeltaNet layers 6 x Dk x Dv per token per value head (the recurrence's three K x V
    products: prediction, update, read)."""
    cfg = text_config(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    q35 = cfg.get("model_type", "").startswith("qwen3_5_moe")
    gate = 2 if q35 else 1  # Qwen3.5's q_proj also emits the per-head output gate
    attn = h * nh * d * gate + 2 * h * nkv * d + nh * d * h
    moe = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"] + cfg["num_experts"] * h
    fs = cfg.get("shared_expert_intermediate_size", 0) or 0
    if fs:
        moe += 3 * h * fs + h
    fwd = 2 * v * h * s
    for t in layer_types(cfg):
        if t == "linear_attention":
            hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            proj = h * (2 * hk * dk + hv * dv) + h * hv * dv + 2 * h * hv + hv * dv * h
            fwd += 2 * (proj + moe) * s + 6 * dk * dv * hv * s
        else:
            fwd += 2 * (attn + moe) * s + 2 * 2 * (s * s / 2) * nh * d
    return 3 * fwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/models/qwen3-30b-a3b-4layer/config.json")
    ap.add_argument("--seq", default="8192,16384,32768,65536")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="no gradient checkpointing (every activation kept)")
    ap.add_argument("--grad-clip", type=float, default=0.0,
                    help="clip the gradient norm to this before the update (0 = off)")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun: FSDP2 fully_shard per decoder layer and the root")
    args = ap.parse_args()
    dist = None
    rank, world = 0, 1
    if args.fsdp:
        import torch.distributed as dist
        if "LOCAL_RANK" not in os.environ:
            ap.error("--fsdp needs a launch by torchrun (LOCAL_RANK, RANK, WORLD_SIZE unset)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_json = json.load(open(args.config))
    config = AutoConfig.from_pretrained(args.config)
    if hasattr(config, "text_config") and config.text_config is not None:
        config = config.text_config  # the language model of a ConditionalGeneration config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # Grouped-GEMM experts (transformers 5's experts_implementation) and cuDNN attention
    # through SDPA, where this transformers has them.
    experts_impl = "default"
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                     experts_implementation="grouped_mm")
            experts_impl = "grouped_mm"
        except (TypeError, ValueError) as e:
            print(f"experts_implementation=grouped_mm not available ({e}); default experts")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    if args.fsdp:
        # Every rank built the same weights (same seed); sharding keeps 1/world of each.
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4 / 2.5
            from torch.distributed._composable.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if args.compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    model.train()
    # Sharded parameters are DTensors: the foreach AdamW handles them on every torch that has
    # fully_shard; the fused one is kept for the single-GPU step as before.
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True) if args.fsdp
           else torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
    gdn = ""
    if "linear_attention" in layer_types(text_config(cfg_json)):
        try:
            import fla  # noqa: F401
            gdn = ", GDN: flash-linear-attention"
        except ImportError:
            gdn = ", GDN: transformers' PyTorch fallback (torch_chunk_gated_delta_rule)"
    # (numel of a sharded parameter is that of the whole tensor)
    if rank == 0:
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, experts {experts_impl}"
              f"{gdn}" + (f", FSDP2 over {world} GPUs" if args.fsdp else ""), flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    attn_ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION])
    attn_ctx.__enter__()
    rows = []
    for s in [int(x) for x in args.seq.split(",")]:
        try:
            torch.cuda.reset_peak_memory_stats()
            if args.fsdp:  # each rank its own sequence (a generator seeded by the rank)
                gen = torch.Generator(device="cuda")
                gen.manual_seed(1000 + rank)
                ids = torch.randint(0, config.vocab_size, (1, s + 1), device="cuda", generator=gen)
            else:
                ids = torch.randint(0, config.vocab_size, (1, s + 1), device="cuda")
            times = []
            for i in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                if dist is not None:
                    dist.barrier()
                t0 = time.perf_counter()
                # HF shifts the labels inside the loss: labels are the inputs themselves.
                out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
                out.loss.backward()
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            peak = torch.cuda.max_memory_allocated() / 2**30
            if dist is not None:
                # The step is as slow as the slowest rank; memory: the largest rank.
                v = torch.tensor([t, peak], device="cuda", dtype=torch.float64)
                dist.all_reduce(v, op=dist.ReduceOp.MAX)
                t, peak = v.tolist()
            # Per GPU: each rank trains on its own s tokens.
            rows.append((s, t * 1e3, s / t, model_flops(cfg_json, s) / t / 1e12, peak, ""))
        except torch.OutOfMemoryError:
            if dist is not None:
                raise  # the other ranks would wait in a collective forever
            rows.append((s, 0, 0, 0, 0, "out of memory"))
            out = None
            torch.cuda.empty_cache()
        if rank == 0:
            print(rows[-1], flush=True)
    mode = ("no checkpointing" if args.no_checkpointing else "activation checkpointing") + \
        (", torch.compile per decoder layer" if args.compile else ", eager") + \
        (f", grad norm clipped to {args.grad_clip}" if args.grad_clip > 0 else ", no clipping")
    if args.fsdp:
        mode += f", FSDP2 fully_shard per decoder layer + root over {world} GPUs (no EP)"
    if rank == 0:
        print(f"\nPyTorch + HF reference step: {args.config}, bf16, {mode}, "
              f"sdpa (cuDNN/flash), experts {experts_impl}{gdn}")
        per = " per GPU" if args.fsdp else ""
        print(f"{'tokens':>8} | {'step ms':>9} | {'tokens/s' + per:>10} | {'model TF/s' + per:>10} | "
              f"{'peak GiB':>9}")
        for s, ms, tps, tf, peak, err in rows:
            if err:
                print(f"{s:>8} | {err}")
            else:
                print(f"{s:>8} | {ms:>9.1f} | {tps:>10.0f} | {tf:>10.1f} | {peak:>9.2f}")
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
