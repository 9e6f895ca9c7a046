#!/usr/bin/env python3
"""check_hf_export.py — does transformers load a bumblebee export as the same model?

Loads DIR (written by `bumblebee export`) with AutoModelForCausalLM.from_pretrained, reports the
missing / unexpected / mismatched keys (all must be empty), runs the sequences of a golden file
(tools/hf_reference.py's golden.safetensors: input_ids + seq_lens) through it in fp32, one
sequence per batch row, and compares the logits with the golden's (relative L2 error). Exit
status 1 when a key list is non-empty or the error exceeds --tol.

    python3 tools/check_hf_export.py --export DIR --golden tests/golden/NAME/golden.safetensors
"""
import argparse
import sys

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="directory written by bumblebee export")
    ap.add_argument("--golden", required=True, help="golden.safetensors with input_ids, seq_lens, logits")
    ap.add_argument("--tol", type=float, default=1e-5, help="max relative L2 error of the logits")
    args = ap.parse_args()
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32,
                                                       output_loading_info=True)
    model.eval()
    bad = {k: v for k, v in info.items() if v}
    print(f"transformers {transformers.__version__}: loaded {type(model).__name__} from {args.export}; "
          f"loading info: {bad or 'no missing, unexpected or mismatched keys'}")
    g = load_file(args.golden)
    ids, lens = g["input_ids"].long(), g["seq_lens"].tolist()
    out, at = [], 0
    with torch.no_grad():
        for n in lens:
            out.append(model(input_ids=ids[at:at + n][None], use_cache=False).logits[0].float())
            at += n
    logits = torch.cat(out, 0)
    ref = g["logits"].float()
    err = ((logits - ref).norm() / ref.norm()).item()
    print(f"logits vs golden: relative L2 error {err:.3e} over {logits.shape[0]} tokens (tolerance {args.tol:g})")
    sys.exit(1 if bad or err > args.tol else 0)


if __name__ == "__main__":
    main()
