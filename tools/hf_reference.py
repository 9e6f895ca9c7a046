#!/usr/bin/env python3
"""hf_reference.py — golden dumps from the Hugging Face reference implementation.

Builds tiny Qwen3MoeForCausalLM / Qwen2MoeForCausalLM / Qwen3_5MoeForCausalLM (the Qwen3.5
hybrid: Gated DeltaNet and gated full-attention layers) models in fp32 from fixed configs and a
fixed seed, saves each with save_pretrained (config.json + safetensors) into <out>/<name>/, runs
ONE batch (a few sequences of different lengths) forward and backward, and writes
<out>/<name>/golden.safetensors, which tests/cpu/test_parity.cpp compares bumblebee against.

What is computed (all fp32, CPU by default, eager attention, eager experts):

  Each sequence is run through the HF model as its own batch row, one sequence at a time and
  without padding (eager HF attention does not pack sequences; bumblebee packs them into one
  micro-batch, which is equivalent because its attention never crosses a sequence boundary).

  ce_loss  = sum over sequences s, positions j < L_s - 1 of CE(logits_s[j], ids_s[j + 1])
             / N,  N = sum_s (L_s - 1) predicted tokens
  aux_loss = transformers' load_balancing_loss_func over the router logits of ALL MoE layers
             and ALL tokens of the batch (what HF computes for one batch row holding every
             token, or for a padded batch with its attention mask):
               E * sum_e (c_e / R) * (P_e / R)
             R = (number of MoE layers) x (tokens in the batch), c_e = number of (row, k) top-k
             assignments to expert e over all layers, P_e = sum over all layers and tokens of
             softmax(router logits)[e]. The layers are POOLED (counts and probabilities summed
             over layers before the product), not averaged per layer. Gradients flow through the
             probabilities only (the counts come from a one-hot of the top-k selection).
  loss     = ce_loss + router_aux_loss_coef * aux_loss      (what HF's forward adds when
             output_router_logits=True and labels are given)

  The router logits are recomputed from the gate's input inside a forward hook
  (F.linear(h, gate.weight)), so the definition above does not depend on what a transformers
  version records as "router_logits" (some 5.x versions recorded softmax probabilities there).
  The aux loss from the logits HF itself records is stored too (aux_loss_recorded) and the
  script warns when the two differ.

golden.safetensors holds (expert names as the saved checkpoint spells them: the classic
per-expert names for Qwen3-MoE / Qwen2-MoE, whose save_pretrained writes those, and the fused
mlp.experts.gate_up_proj / down_proj for Qwen3.5, whose checkpoints are fused; bumblebee's
hf_tensors() uses the same names per family):

  input_ids      i32 [T]     the sequences concatenated
  seq_lens       i32 [B]     their lengths
  logits         f32 [T, V]  every position (the last token of each sequence included)
  ce_loss, aux_loss, aux_loss_recorded, loss   f32 [1]  (and as float64 text in the metadata)
  routing.<l>    i32 [T, K]  top-k experts of MoE layer l (descending probability)
  grad.<name>    f32         d loss / d parameter, for every parameter
  grad_ce.<name> f32         d ce_loss / d parameter (no aux term), for every parameter

The weights are re-drawn after construction (normal, std 0.15 for matrices, 1 + 0.1 normal for
norms, 0.1 normal for biases; Qwen3.5's zero-centred norms, which scale by 1 + w, get 0.1 normal,
its GDN decay parameters A_log = log U(0.05, 0.5) and dt_bias 0.1 normal, so the state keeps a
memory of tens of tokens) so every path carries signal in a two-layer model, and the seed is
bumped until every top-k choice has a clear margin (so fp32 rounding differences between
implementations cannot flip an expert choice) and every expert receives tokens in every layer.

--train-steps N additionally trains each model N steps (AdamW, constant lr, grad clipping) on
the golden batch, starting from the saved weights, and writes <out>/<name>/loss_curve.json.

Usage (needs torch and transformers; the goldens in tests/golden were made with CPU fp32):
  python tools/hf_reference.py --out tests/golden
  python tools/hf_reference.py --out tests/golden --train-steps 20
"""

import argparse
import glob
import json
import math
import os
import re
import sys

import torch
import torch.nn.functional as F

SEQ_LENS = [9, 5, 12]
# Qwen3.5: one sequence longer than the 64-token chunk of the GDN kernels, a 3-token one and a
# middle one, so chunk boundaries and short sequences are both in the golden.
SEQ_LENS_QWEN3_5 = [70, 3, 33]
# The --train-steps learning rate of the Qwen3.5 goldens (--lr overrides it). At 3e-3 this model
# memorises the batch within a few steps and its trajectory is chaotic: a 1e-6 relative
# difference after step 1 grows ~30x per step (measured against bumblebee's fp32 trainer), so
# no implementation can follow it for 20 steps; a smaller rate keeps the curve comparable.
CURVE_LR_QWEN3_5 = float(os.environ.get("BB_CURVE_LR_QWEN3_5", "1e-3"))
MATRIX_STD = 0.15

# Keys bumblebee's config parser understands (src/models/config.cpp); anything else in the
# saved config.json makes bumblebee refuse the checkpoint, so the script warns about it.
BUMBLEBEE_KNOWN_KEYS = {
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "output_router_logits", "sliding_window", "max_window_layers", "pad_token_id",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "rope_theta", "rope_scaling", "rope_parameters",
    "rms_norm_eps", "router_aux_loss_coef", "initializer_range", "tie_word_embeddings",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "hidden_act",
    "use_sliding_window", "attention_bias", "attention_dropout", "layer_types",
    "shared_expert_intermediate_size", "qkv_bias",
    # qwen3_5_moe_text
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
    "partial_rotary_factor", "attn_output_gate", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "pad_token_id",
}


def tiny_configs():
    """name -> (family, config kwargs). hidden 32, 2 layers, 4 experts top-2, vocab 64."""
    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=False, attention_dropout=0.0,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
        router_aux_loss_coef=0.1, bos_token_id=1, eos_token_id=2, use_sliding_window=False,
    )
    qwen3 = dict(common, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 tie_word_embeddings=False, attention_bias=False)
    # Qwen2-MoE: layer 0 dense (mlp_only_layers), layer 1 MoE with a shared expert; q/k/v
    # biases; no top-k renormalisation; tied embeddings.
    qwen2 = dict(common, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
                 shared_expert_intermediate_size=24, qkv_bias=True, tie_word_embeddings=True)
    # GPU variants: the same models with head_dim 128 (what the cuDNN attention path takes), a
    # wider routing margin, so bf16 rounding on the GPU cannot flip a top-k choice, and weights
    # that are bf16 numbers, so the GPU model's bf16 weights equal the reference's.
    d128 = dict(head_dim=128, min_routing_margin=1e-2, bf16_values=True)
    # Qwen3.5: 4 layers (3 Gated DeltaNet + 1 gated full attention), 8 experts top-2 plus a
    # shared expert in every layer, untied; GDN 2 key / 4 value heads of dim 16; attention 4 / 2
    # heads of dim 16 with partial RoPE on the first quarter of each head.
    qwen3_5 = dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=256,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=False, attention_dropout=0.0,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, router_aux_loss_coef=0.1, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, attention_bias=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
        seq_lens=SEQ_LENS_QWEN3_5, router_std=0.5, margin_in_logits=True,
        curve_lr=CURVE_LR_QWEN3_5)
    # GPU variant: the head dims the CUDA paths take and the real model has (attention 256,
    # GDN 128; 2 query heads on 1 KV head, 1 key head serving 2 value heads), bf16-exact
    # weights; 4 experts and 16 tokens with spread router logits, so that a logit margin of 0.3
    # can be found for every token-layer choice (a 0.08 margin let one choice flip on an H200).
    # This tiny hybrid is badly conditioned for bf16 (bumblebee's own CPU path with bf16
    # storage moves its logits by 4e-2 and its gradients by 15% on average), so the GPU test
    # measures that yardstick and holds the GPU to it (tests/gpu/test_parity_gpu.cpp);
    # `matrix_std` draws smaller matrices if a better-conditioned golden is wanted. Few heads
    # keep the golden small (about 5 MB).
    qwen3_5_gpu = dict(qwen3_5, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
                       linear_value_head_dim=128, num_experts=4, seq_lens=[9, 2, 5],
                       router_std=1.0, min_routing_margin=0.3, bf16_values=True)
    return {"qwen3_moe_tiny": ("qwen3_moe", qwen3), "qwen2_moe_tiny": ("qwen2_moe", qwen2),
            "qwen3_moe_tiny_d128": ("qwen3_moe", dict(qwen3, **d128)),
            "qwen2_moe_tiny_d128": ("qwen2_moe", dict(qwen2, **d128)),
            "qwen3_5_moe_tiny": ("qwen3_5_moe", qwen3_5),
            "qwen3_5_moe_tiny_gpu": ("qwen3_5_moe", qwen3_5_gpu)}


def build_config(family, kw):
    import transformers
    if family == "qwen3_5_moe":
        kw = dict(kw)
        prf = kw.pop("partial_rotary_factor")
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf}
        cfg = transformers.Qwen3_5MoeTextConfig(**kw, rope_parameters=rope)
        got = cfg.rope_parameters.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
        assert got == prf, f"partial_rotary_factor {got}, wanted {prf}"
        assert list(cfg.layer_types) == kw["layer_types"], cfg.layer_types
        return cfg
    cls = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.Qwen2MoeConfig
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    try:
        cfg = cls(**kw, rope_parameters=rope)  # transformers 5.x
    except TypeError:
        cfg = cls(**kw, rope_theta=10000.0)  # transformers 4.x
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = kw.get("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    assert head_dim == want, f"config head_dim {head_dim}, wanted {want}"

    return cfg


def build_model(family, cfg):
    import transformers
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "qwen3_5_moe": getattr(transformers, "Qwen3_5MoeForCausalLM", None)}[family]
    if cls is None:
        raise SystemExit(f"transformers {transformers.__version__} has no Qwen3_5MoeForCausalLM")
    model = cls(cfg).float()
    # Reference paths: explicit softmax attention and the per-expert loop.
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        model.config._attn_implementation = "eager"
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model.train()  # dropout is 0: train/eval compute the same; train mirrors the use
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings not tied"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = next(l.self_attn for l in model.model.layers if hasattr(l, "self_attn"))
    q_rows = attn.q_proj.weight.shape[0]
    gate = 2 if family == "qwen3_5_moe" else 1  # Qwen3.5's q_proj also emits the output gate
    if q_rows != cfg.num_attention_heads * head_dim * gate:
        raise SystemExit(f"{type(model).__name__} ignores head_dim {head_dim} (q_proj has {q_rows} "
                         f"rows) in transformers {transformers.__version__}")
    return model


@torch.no_grad()
def reinit(model, seed, bf16_values=False, zero_centred_norms=False, router_std=None,
           matrix_std=MATRIX_STD):
    """bf16_values: every weight is a bf16 number (stored in fp32), so a bf16 model holds the
    reference's weights exactly and the comparison measures only the bf16 arithmetic.
    zero_centred_norms: the model's RMSNorms scale by 1 + w (Qwen3.5), except the GDN output
    norm (linear_attn.norm), which scales by w.
    router_std: std of the router weights (mlp.gate.weight) instead of MATRIX_STD, so that the
    router logits are spread enough for every top-k choice to have a clear margin."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("A_log"):
            u = torch.rand(p.shape, generator=g, dtype=torch.float32)
            v = torch.log(0.05 + 0.45 * u)
        elif name.endswith("dt_bias"):
            v = 0.1 * r
        elif router_std is not None and name.endswith("mlp.gate.weight"):
            v = router_std * r
        elif "norm" in name and zero_centred_norms and not name.endswith("linear_attn.norm.weight"):
            v = 0.1 * r
        elif "norm" in name:
            v = 1.0 + 0.1 * r
        elif name.endswith(".bias"):
            v = 0.1 * r
        else:
            v = matrix_std * r
        p.copy_(v.bfloat16().float() if bf16_values else v)


def make_batch(vocab, seed, seq_lens=None):
    g = torch.Generator().manual_seed(seed + 7777)
    return [torch.randint(0, vocab, (n,), generator=g, dtype=torch.int64)
            for n in (seq_lens or SEQ_LENS)]


def gate_modules(model):
    """[(layer index, gate module)] of the MoE layers, in layer order."""
    out = []
    for name, m in model.named_modules():
        mm = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate", name)
        if mm:
            out.append((int(mm.group(1)), m))
    return sorted(out, key=lambda x: x[0])


def load_balancing_fn(model):
    return sys.modules[type(model).__module__].load_balancing_loss_func


def run_batch(model, seqs):
    """Forward every sequence; returns logits list, per-layer raw router logits (concatenated
    over sequences), per-layer recorded router logits, per-sequence HF outputs."""
    gates = gate_modules(model)
    captured = {l: [] for l, _ in gates}
    hooks = []
    for l, m in gates:
        def hook(mod, inp, out, l=l):
            h = inp[0].reshape(-1, mod.weight.shape[1])
            mine = F.linear(h, mod.weight)
            rec = out[0] if isinstance(out, tuple) else out
            captured[l].append((mine, rec))
        hooks.append(m.register_forward_hook(hook))
    logits, outs = [], []
    try:
        for s in seqs:
            o = model(input_ids=s[None, :], output_router_logits=True, use_cache=False)
            logits.append(o.logits[0])
            outs.append(o)
    finally:
        for h in hooks:
            h.remove()
    raw = [torch.cat([m for m, _ in captured[l]], 0) for l, _ in gates]
    recorded = [torch.cat([r for _, r in captured[l]], 0) for l, _ in gates]
    return logits, raw, recorded, outs, [l for l, _ in gates]


def losses(model, seqs, logits, raw):
    cfg = model.config
    ce_sum = sum(F.cross_entropy(lg[:-1], s[1:], reduction="sum") for lg, s in zip(logits, seqs))
    n_pred = sum(len(s) - 1 for s in seqs)
    ce = ce_sum / n_pred
    aux = load_balancing_fn(model)(tuple(raw), cfg.num_experts, cfg.num_experts_per_tok, None)
    return ce, aux, ce + cfg.router_aux_loss_coef * aux, n_pred


def routing_stats(raw, k, num_experts, in_logits=False):
    """(min margin between the k-th and (k+1)-th choice, every expert used in every layer).
    The margin is in probability, or with in_logits in router logits (what rounding perturbs:
    with spread logits the k-th and (k+1)-th probabilities can both be tiny and close while
    their logits are far apart)."""
    margin, all_used = float("inf"), True
    for lg in raw:
        x = lg.detach().double()
        vals = x if in_logits else torch.softmax(x, -1)
        top = torch.topk(vals, min(k + 1, vals.shape[-1]), -1).values
        if top.shape[-1] > k:
            margin = min(margin, (top[:, k - 1] - top[:, k]).min().item())
        used = torch.bincount(torch.topk(vals, k, -1).indices.reshape(-1), minlength=num_experts)
        all_used &= bool((used > 0).all())
    return margin, all_used


def saved_names(named, fused):
    """Parameters (or grads) by name, under the checkpoint's names: classic_names() for a
    per-expert checkpoint, the names as they are for a fused one (Qwen3.5)."""
    if not fused:
        return classic_names(named)
    return {n: t.detach().float().cpu().contiguous() for n, t in named}


def is_fused_checkpoint(dirname):
    return any(k.endswith("mlp.experts.gate_up_proj") for k in read_saved(dirname))


def classic_names(named):
    """Parameters (or grads) by name -> classic per-expert HF names.

    transformers 5 keeps experts fused: mlp.experts.gate_up_proj [E, 2F, H] (gate rows first,
    then up rows: forward does .chunk(2, dim=-1) on x @ W^T) and mlp.experts.down_proj
    [E, H, F]. Checkpoints (save_pretrained's default) use mlp.experts.<e>.{gate,up,down}_proj.
    """
    out = {}
    for name, t in named:
        t = t.detach().float().cpu().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            assert t.dim() == 3 and t.shape[1] % 2 == 0, (name, t.shape)
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :f].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, f:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            assert t.dim() == 3, (name, t.shape)
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def read_saved(dirname):
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(glob.glob(os.path.join(dirname, "*.safetensors"))):
        if os.path.basename(f) == "golden.safetensors":
            continue
        tensors.update(load_file(f))
    return tensors


def check_saved_matches(model, dirname, fused=False):
    """The saved checkpoint must hold exactly the names the grads are written under."""
    ours = saved_names(model.named_parameters(), fused)
    saved = saved_names(read_saved(dirname).items(), fused)
    if model.config.tie_word_embeddings:
        saved.pop("lm_head.weight", None)
    assert set(ours) == set(saved), (
        f"saved names differ: only in model {sorted(set(ours) - set(saved))[:8]}, "
        f"only in file {sorted(set(saved) - set(ours))[:8]}")
    for n, t in ours.items():
        assert torch.equal(t, saved[n]), f"saved tensor {n} differs from the model's"
    return ours


def check_config_json(dirname):
    with open(os.path.join(dirname, "config.json")) as f:
        j = json.load(f)
    unknown = sorted(set(j) - BUMBLEBEE_KNOWN_KEYS)
    if unknown:
        print(f"  WARNING: config.json has keys bumblebee does not know: {unknown}")
    return j


def make_golden(name, family, kw, out_root, seed, device):
    import transformers
    kw = dict(kw)
    min_margin = kw.pop("min_routing_margin", 1e-3)
    bf16_values = kw.pop("bf16_values", False)
    seq_lens = kw.pop("seq_lens", SEQ_LENS)
    router_std = kw.pop("router_std", None)
    kw.pop("curve_lr", None)
    margin_in_logits = kw.pop("margin_in_logits", False)
    matrix_std = kw.pop("matrix_std", MATRIX_STD)
    zero_centred = family == "qwen3_5_moe"
    cfg = build_config(family, kw)
    for attempt in range(400):
        s = seed + attempt
        torch.manual_seed(s)
        model = build_model(family, cfg)
        reinit(model, s, bf16_values, zero_centred, router_std, matrix_std)
        seqs = make_batch(cfg.vocab_size, s, seq_lens)
        with torch.no_grad():
            _, raw, _, _, _ = run_batch(model, seqs)
        margin, all_used = routing_stats(raw, cfg.num_experts_per_tok, cfg.num_experts,
                                         margin_in_logits)
        if margin > min_margin and all_used:
            break
        print(f"  seed {s}: routing margin {margin:.2e}, all experts used {all_used}; next seed")
    else:
        raise SystemExit(f"{name}: no seed with a clear routing margin")

    model.to(device)
    seqs = [x.to(device) for x in seqs]
    dirname = os.path.join(out_root, name)
    os.makedirs(dirname, exist_ok=True)
    for f in glob.glob(os.path.join(dirname, "*.safetensors*")):
        os.remove(f)
    model.save_pretrained(dirname, safe_serialization=True)
    check_config_json(dirname)
    fused = is_fused_checkpoint(dirname)
    classic_params = check_saved_matches(model, dirname, fused)

    logits, raw, recorded, outs, moe_layers = run_batch(model, seqs)
    ce, aux, loss, n_pred = losses(model, seqs, logits, raw)
    aux_rec = load_balancing_fn(model)(tuple(recorded), cfg.num_experts,
                                       cfg.num_experts_per_tok, None)
    if not torch.allclose(aux_rec, aux, rtol=1e-6, atol=0):
        print(f"  WARNING: this transformers version records something other than the raw router "
              f"logits: aux from its recorded router_logits = {aux_rec.item():.9g}, from the "
              f"logits = {aux.item():.9g}. The golden uses the logits (see the docstring).")

    # Sanity: for one sequence, HF's own training loss (labels given) is CE mean + coef * aux of
    # the router logits it records, i.e. the combination used for the batch above.
    s0 = seqs[0]
    o = model(input_ids=s0[None], labels=s0[None], output_router_logits=True, use_cache=False)
    ce0 = F.cross_entropy(outs[0].logits[0][:-1], s0[1:])
    aux0 = load_balancing_fn(model)(tuple(r[: len(s0)] for r in recorded), cfg.num_experts,
                                    cfg.num_experts_per_tok, None)
    want = ce0 + cfg.router_aux_loss_coef * aux0
    assert torch.allclose(o.loss, want, rtol=1e-6), (o.loss.item(), want.item())

    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    g_total = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    g_ce = torch.autograd.grad(ce, params, allow_unused=True)
    zero = lambda g, p: torch.zeros_like(p) if g is None else g
    grads = saved_names(((n, zero(g, p)) for n, g, p in zip(names, g_total, params)), fused)
    grads_ce = saved_names(((n, zero(g, p)) for n, g, p in zip(names, g_ce, params)), fused)
    assert set(grads) == set(classic_params)

    k = cfg.num_experts_per_tok
    out = {
        "input_ids": torch.cat(seqs).to(torch.int32).cpu(),
        "seq_lens": torch.tensor([len(x) for x in seqs], dtype=torch.int32),
        "logits": torch.cat(logits, 0).detach().float().cpu().contiguous(),
        "ce_loss": ce.detach().float().reshape(1).cpu(),
        "aux_loss": aux.detach().float().reshape(1).cpu(),
        "aux_loss_recorded": aux_rec.detach().float().reshape(1).cpu(),
        "loss": loss.detach().float().reshape(1).cpu(),
    }
    for l, lg in zip(moe_layers, raw):
        idx = torch.topk(torch.softmax(lg.detach(), -1), k, -1).indices
        out[f"routing.{l}"] = idx.to(torch.int32).cpu().contiguous()
    for n, g in grads.items():
        out[f"grad.{n}"] = g.cpu()
    for n, g in grads_ce.items():
        out[f"grad_ce.{n}"] = g.cpu()
    margin, _ = routing_stats(raw, k, cfg.num_experts, margin_in_logits)
    meta = {
        "format": "pt",
        "model": name,
        "seed": str(s),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": str(device),
        "num_predicted": str(n_pred),
        "router_aux_loss_coef": repr(float(cfg.router_aux_loss_coef)),
        "ce_loss": repr(ce.item()),
        "aux_loss": repr(aux.item()),
        "aux_loss_recorded": repr(aux_rec.item()),
        "loss": repr(loss.item()),
        "min_routing_margin": repr(margin),
        "routing_margin_in": "router logits" if margin_in_logits else "probability",
        "expert_layout": "fused" if fused else "per_expert",
        "definition": "loss = CE summed over sequences / num_predicted + router_aux_loss_coef * "
                      "HF load_balancing_loss_func over all MoE layers and all tokens",
    }
    from safetensors.torch import save_file
    save_file(out, os.path.join(dirname, "golden.safetensors"), metadata=meta)
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(dirname, "*")))
    print(f"{name}: seed {s}, T={sum(seq_lens)} tokens in {len(seq_lens)} sequences, "
          f"ce {ce.item():.6f} aux {aux.item():.6f} loss {loss.item():.6f}, "
          f"routing margin {margin:.2e}, {len(grads)} grads, dir {size / 1024:.0f} KiB")
    return model, seqs


def train_curve(name, model, seqs, out_root, steps, lr):
    """AdamW on the golden batch for `steps` steps, from the saved weights."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    hp = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=hp["betas"], eps=hp["eps"])
    curve = {"loss": [], "aux_loss": [], "grad_norm": []}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits, raw, _, _, _ = run_batch(model, seqs)
        ce, aux, loss, _ = losses(model, seqs, logits, raw)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["grad_clip"])
        opt.step()
        curve["loss"].append(ce.item())
        curve["aux_loss"].append(aux.item())
        curve["grad_norm"].append(gn.item())
    j = {
        "model": name,
        "steps": steps,
        "data": "the golden batch (input_ids / seq_lens of golden.safetensors) at every step",
        "start": "the weights saved in this directory",
        "objective": "ce_loss + router_aux_loss_coef * aux_loss (as in golden.safetensors)",
        "optimizer": "torch.optim.AdamW, constant lr; weight decay on parameters with dim >= 2 "
                     "only; clip_grad_norm_ (scale max_norm / (norm + 1e-6)) before the step",
        "hyperparameters": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hp.items()},
        "loss": curve["loss"],  # ce_loss before each step's update
        "aux_loss": curve["aux_loss"],
        "grad_norm": curve["grad_norm"],  # before clipping
    }
    path = os.path.join(out_root, name, "loss_curve.json")
    with open(path, "w") as f:
        json.dump(j, f, indent=1)
    print(f"{name}: {steps} AdamW steps, loss {curve['loss'][0]:.4f} -> {curve['loss'][-1]:.4f} "
          f"({path})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/golden", help="root directory of the golden dirs")
    ap.add_argument("--models", default="qwen3_moe_tiny,qwen2_moe_tiny",
                    help="comma-separated subset of: " + ", ".join(sorted(tiny_configs())))
    ap.add_argument("--seed", type=int, default=0, help="first seed tried (bumped if needed)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu keeps fp32 exact)")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also train N AdamW steps and write loss_curve.json (0 = off)")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate of --train-steps (default 3e-3; the Qwen3.5 goldens "
                         "use CURVE_LR_QWEN3_5)")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    configs = tiny_configs()
    for name in args.models.split(","):
        if name not in configs:
            raise SystemExit(f"unknown model '{name}': choose from {sorted(configs)}")
        family, kw = configs[name]
        model, seqs = make_golden(name, family, kw, args.out, args.seed, args.device)
        if args.train_steps > 0:
            lr = args.lr if args.lr is not None else kw.get("curve_lr", 3e-3)
            train_curve(name, model, seqs, args.out, args.train_steps, lr)


if __name__ == "__main__":
    main()
