#!/usr/bin/env python3
"""The Python API (python/bumblebee) over libbumblebee_c.so, against independent paths:
- logprobs() (C logits, softmax in double) against the cross-entropy head's loss of a step on
  the same documents, and its entropies against the policy head's entropy metric;
- two trainers of one seed give the same steps; save / load restores the log-probs exactly;
- offload() / onload() in between steps changes nothing (the next step against a twin's);
- weights() against the model's Hugging Face names and shapes, its bf16 form against Python's
  own round-to-nearest-even of the f32 values, weight_buckets() covering them in order;
  export_hf writes a model;
- errors arrive as bumblebee.Error with the library's message.
Runs with and without numpy (the results' two forms). Usage: test_api.py LIBRARY
"""

import math
import os
import shutil
import struct
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import bumblebee  # noqa: E402

LIB = sys.argv[1] if len(sys.argv) > 1 else None
BASE = ['data.path="none"', 'checkpoint.dir=""', 'log.metrics=""', "log.every=1000000000",
        "train.micro_batch_tokens=512", "train.lr=1e-3", "train.warmup_steps=0"]
passed, failed = 0, 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what)


def docs():
    out = []
    for i in range(5):
        n = 20 + 7 * i
        toks = [(17 * i + 31 * j) % 256 for j in range(n)]
        out.append({"tokens": toks, "loss_mask": [0] * 5 + [1] * (n - 5), "advantages": 0.5 - 0.25 * i})
    return out


def run(mode):
    tmp = tempfile.mkdtemp(prefix="bb_pyapi_")
    try:
        # logprobs() against the cross-entropy of a step: loss = mean over trained tokens of -logp.
        ce = bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.loss="linear_ce"'], library=LIB)
        lps = ce.logprobs([d["tokens"] for d in docs()])
        nll, n = 0.0, 0
        for d, (lp, _) in zip(docs(), lps):
            check(len(lp) == len(d["tokens"]) and float(lp[0]) == 0.0, mode + ": logprobs shape / entry 0")
            for j in range(1, len(d["tokens"])):
                if d["loss_mask"][j]:
                    nll -= float(lp[j])
                    n += 1
        m = ce.train_batch(docs())
        check(abs(m["loss"] - nll / n) < 1e-5 * abs(m["loss"]), mode + ": CE loss %r vs -mean logprob %r" % (m["loss"], nll / n))
        check(m["valid_tokens"] == n, mode + ": valid tokens")

        # The policy head's entropy metric against logprobs()' entropies (before the update).
        pol = bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.loss="policy"'], library=LIB)
        ents = pol.logprobs([d["tokens"] for d in docs()])
        h, k = 0.0, 0
        for d, (_, ent) in zip(docs(), ents):
            for j in range(1, len(d["tokens"])):
                if d["loss_mask"][j]:
                    h += float(ent[j])
                    k += 1
        pm = pol.train_batch(docs())
        check(abs(pm["entropy"] - h / k) < 1e-5 * h / k, mode + ": entropy %r vs %r" % (pm["entropy"], h / k))
        check(pm["ratio_mean"] == 1.0 and pm["clip_frac"] == 0.0, mode + ": on-policy ratio 1")
        check(all(name in pm for name in ("approx_kl", "ref_kl", "sequences", "grad_norm")), mode + ": metric names")
        check(abs(pm["sequences"] - 5) < 1e-5, mode + ": sequences %r" % pm["sequences"])

        # Same seed, same batch: the same step; save / load restores the log-probs exactly.
        # (No clipping: pol2's update runs inside its backward, [backend] optimizer_in_backward.)
        pol2 = bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.loss="policy"', "train.grad_clip=0"], library=LIB)
        pm2 = pol2.train_batch(docs())
        check(pm2["loss"] == pm["loss"] and pm2["grad_norm"] == pm["grad_norm"], mode + ": determinism")
        saved = pol.save(os.path.join(tmp, "ckpt"))
        check(os.path.isdir(saved) and pol.step == 1, mode + ": save " + saved)
        before = [list(map(float, lp)) for lp, _ in pol.logprobs([d["tokens"] for d in docs()])]
        pol.train_batch(docs())
        moved = [list(map(float, lp)) for lp, _ in pol.logprobs([d["tokens"] for d in docs()])]
        check(moved != before, mode + ": a step changes the log-probs")
        pol.load(saved)
        after = [list(map(float, lp)) for lp, _ in pol.logprobs([d["tokens"] for d in docs()])]
        check(after == before and pol.step == 1, mode + ": load restores the log-probs")

        # numpy arrays (and torch tensors, through numpy) as documents: the step the lists give,
        # routing as a [tokens, layers, top-k] array included (router replay reads it).
        if mode == "numpy":
            np = bumblebee._np
            rep = BASE + ['primitives.loss="policy"', "train.grad_clip=0", "primitives.router_replay=true"]
            listed = []
            for i, d in enumerate(docs()):
                n = len(d["tokens"])
                routing = [[[(i + j + l) % 8, (i + j + l + 3) % 8] for l in range(3)] for j in range(n)]
                listed.append(dict(d, routing=routing))
            arrays = [{"tokens": np.array(d["tokens"], dtype=np.int64), "loss_mask": np.array(d["loss_mask"], dtype=bool),
                       "advantages": np.float64(d["advantages"]), "routing": np.array(d["routing"], dtype=np.int16)}
                      for d in listed]
            ta = bumblebee.Trainer("configs/demo.toml", rep, library=LIB)
            tb = bumblebee.Trainer("configs/demo.toml", rep, library=LIB)
            ma, mb = ta.train_batch(arrays), tb.train_batch(listed)
            check(ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"], mode + ": arrays train as lists")
            for bad, needle in [
                (dict(arrays[0], routing=arrays[0]["routing"][1:]), "one entry per token"),
                (dict(arrays[0], tokens=np.array([2 ** 32 + 5, 6], dtype=np.int64)), "outside what it can be"),
                (dict(arrays[0], tokens=np.array([1.5, 2.0])), "must hold integers"),
                (dict(arrays[0], tokens=np.int64(7)), "must be an array, got a scalar"),
                (dict(arrays[0], loss_mask=np.full(len(arrays[0]["tokens"]), 256)), "outside what it can be"),
            ]:
                try:
                    ta.train_batch([bad])
                    check(False, mode + ": no error for " + needle)
                except bumblebee.Error as e:
                    check(needle in str(e), mode + ": %r not in %r" % (needle, str(e)))
            ta.close()
            tb.close()

        # forward_backward + optim_step is train_batch split in two: the same metrics, the same
        # weights after (pol2 took one train_batch, its update fused into the backward, from the
        # same start as pol3 here, whose update waits for optim_step).
        pol3 = bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.loss="policy"', "train.grad_clip=0"], library=LIB)
        fb = pol3.forward_backward(docs())
        check(fb["loss"] == pm2["loss"] and fb["grad_norm"] == pm2["grad_norm"], mode + ": forward_backward metrics")
        check(pol3.step == 0, mode + ": no step before optim_step")
        for call, needle in [(lambda: pol3.forward_backward(docs()), "call optim_step first"),
                             (lambda: pol3.train_batch(docs()), "call optim_step first")]:
            try:
                call()
                check(False, mode + ": no error for " + needle)
            except bumblebee.Error as e:
                check(needle in str(e), mode + ": %r not in %r" % (needle, str(e)))
        om = pol3.optim_step()
        check(om["loss"] == pm2["loss"] and om["grad_norm"] == pm2["grad_norm"] and om["step"] == 1, mode + ": optim_step")
        a2 = [list(map(float, lp)) for lp, _ in pol2.logprobs([d["tokens"] for d in docs()])]
        a3 = [list(map(float, lp)) for lp, _ in pol3.logprobs([d["tokens"] for d in docs()])]
        check(a2 == a3, mode + ": the same weights after the split step")
        try:
            pol3.optim_step()
            check(False, mode + ": a second optim_step")
        except bumblebee.Error as e:
            check("no forward_backward to apply" in str(e), mode + ": " + str(e))
        pol3.close()

        # offload() / onload(): the next step after them is the step without them (pol2 and a
        # fresh pol4 from the same start, the same two batches), and the model is refused between.
        pol4 = bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.loss="policy"', "train.grad_clip=0"], library=LIB)
        pol4.train_batch(docs())
        off = pol4.offload()
        check(off["host_bytes"] > 0 and off["device_used"] == -1 and off["seconds"] >= 0, mode + ": offload %r" % off)
        try:
            pol4.train_batch(docs())
            check(False, mode + ": a step while offloaded")
        except bumblebee.Error as e:
            check("call onload() first" in str(e), mode + ": " + str(e))
        on = pol4.onload()
        check(on["host_bytes"] == off["host_bytes"], mode + ": onload %r" % on)
        s4 = pol4.train_batch(docs())
        s2 = pol2.train_batch(docs())
        check(s4["loss"] == s2["loss"] and s4["grad_norm"] == s2["grad_norm"], mode + ": the step after onload")
        pol4.close()

        # Generation: deterministic by seed, new tokens in the vocabulary, stop token honoured.
        g1 = pol.generate([[1, 2, 3], [4, 5]], 6, seed=3)
        g2 = pol.generate([[1, 2, 3], [4, 5]], 6, seed=3)
        check(g1 == g2 and all(len(g) == 6 and all(0 <= x < 264 for x in g) for g in g1), mode + ": generate")
        gs = pol.generate([[1, 2, 3]], 50, seed=4, stop_token=g1[0][0])
        check(len(gs[0]) <= 50 and (len(gs[0]) == 50 or gs[0][-1] == g1[0][0]), mode + ": stop token")
        last = pol.last_logits([[1, 2, 3]])
        check(len(last) == 1 and len(last[0]) == 264, mode + ": last_logits shape")

        # Weights under Hugging Face names; export.
        w = dict(pol.weights())
        emb = w["model.embed_tokens.weight"]
        check(emb.shape == (264, 128) if mode == "numpy" else len(emb) == 264 * 128, mode + ": embedding shape")
        check("model.layers.1.mlp.experts.0.down_proj.weight" in w, mode + ": per-expert names")
        # bf16 weights: the f32 values rounded to nearest even (Python's own rounding of the bits).
        emb16 = dict(pol.weights("bfloat16"))["model.embed_tokens.weight"]
        f32 = [float(x) for x in (emb.reshape(-1) if mode == "numpy" else emb)]
        if hasattr(emb16, "view") and hasattr(emb16, "dtype") and "bfloat16" in str(emb16.dtype):
            import torch
            got16 = emb16.reshape(-1).view(torch.int16).numpy().astype("uint16").tolist()
        else:
            got16 = [int(x) for x in (emb16.reshape(-1) if mode == "numpy" else emb16)]
        want16 = []
        for x in f32:
            b = struct.unpack("<I", struct.pack("<f", x))[0]
            want16.append(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)
        check(got16 == want16, mode + ": bf16 weights are the f32 weights rounded to nearest even")
        buckets = list(pol.weight_buckets(bucket_bytes=64 * 1024))
        check(sum(len(b) for b in buckets) == len(w) and len(buckets) > 1, mode + ": weight buckets cover every weight")
        check([n for b in buckets for n, _ in b] == list(w.keys()), mode + ": buckets in weights() order")
        try:
            next(pol.weights("float16"))
            check(False, mode + ": no error for dtype float16")
        except bumblebee.Error as e:
            check("'float32' or 'bfloat16'" in str(e), mode + ": " + str(e))
        pol.export_hf(os.path.join(tmp, "hf"))
        check(os.path.exists(os.path.join(tmp, "hf", "config.json")) and
              os.path.exists(os.path.join(tmp, "hf", "model.safetensors")), mode + ": export_hf files")

        # Errors: bumblebee.Error with the library's message.
        for call, needle in [
            (lambda: pol.train_batch([{"tokens": [1, 2, 999], "advantages": 1.0}]), "outside [0, 264)"),
            (lambda: pol.train_batch([{"tokens": [1, 2, 3]}]), 'has no "advantages"'),
            (lambda: pol.train_batch([{"tokens": [1, 2, 3], "advantages": [1.0]}]), "'advantages' has 1 entries for 3 tokens"),
            (lambda: pol.train_batch([{"tokens": [1, 2], "advantages": 1.0, "old_logprobs": [0, 0.5]}]), "log-probs are finite and <= 0"),
            (lambda: pol.train_batch([{"tokens": [1, 2], "rewards": 1}]), "unknown key(s) ['rewards']"),
            (lambda: pol.train_batch([{"tokens": list(range(200)) * 3, "advantages": 1.0}]), "more than a micro-batch holds"),
            (lambda: pol.train_step(), 'data.path = "none"'),
            (lambda: bumblebee.Trainer("configs/demo.toml", ["train.lr=oops"], library=LIB), "train.lr"),
            (lambda: bumblebee.Trainer("/nonexistent.toml", library=LIB), "nonexistent"),
        ]:
            try:
                call()
                check(False, mode + ": no error for " + needle)
            except bumblebee.Error as e:
                check(needle in str(e), mode + ": %r not in %r" % (needle, str(e)))
        for t in (ce, pol, pol2):
            t.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
modes = ["lists"]
if bumblebee._np is not None:
    modes.insert(0, "numpy")
for mode in modes:
    saved_np = bumblebee._np
    if mode == "lists":
        bumblebee._np = None
    run(mode)
    bumblebee._np = saved_np
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
