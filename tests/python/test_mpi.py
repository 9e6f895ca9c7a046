#!/usr/bin/env python3
"""The Python API under mpirun, one Python process per rank (as torchrun): two ranks with fsdp
train the step and score the log-probs that one process alone computes on the same batch.

Run plainly, it computes the single-process reference, then starts itself under
`mpirun -np 2` and checks every rank's results against it. Usage: test_mpi.py LIBRARY
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import bumblebee  # noqa: E402

LIB = sys.argv[1] if len(sys.argv) > 1 else None
BASE = ['data.path="none"', 'checkpoint.dir=""', 'log.metrics=""', "log.every=1000000000",
        "train.micro_batch_tokens=256", "train.lr=1e-3", "train.warmup_steps=0", 'primitives.loss="policy"',
        "train.grad_clip=0"]


def docs():
    out = []
    for i in range(6):
        n = 30 + 9 * i
        toks = [(13 * i + 29 * j) % 256 for j in range(n)]
        out.append({"tokens": toks, "loss_mask": [0] * 4 + [1] * (n - 4), "advantages": 0.6 - 0.2 * i})
    return out


def results(t):
    m = t.train_batch(docs())
    lps = t.logprobs([d["tokens"] for d in docs()])
    return {"loss": m["loss"], "grad_norm": m["grad_norm"],
            "logprobs": [[float(x) for x in lp] for lp, _ in lps], "entropy": [[float(x) for x in e] for _, e in lps]}


def main():
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        # The reference: one process, the global batch of two ranks as two micro-batches.
        with bumblebee.Trainer("configs/demo.toml", BASE + ["train.grad_accum=2"], library=LIB) as t:
            ref = results(t)
        tmp = tempfile.mkdtemp(prefix="bb_pympi_")
        try:
            path = os.path.join(tmp, "ref.json")
            with open(path, "w") as f:
                json.dump(ref, f)
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
                   os.path.abspath(__file__), LIB or "", path]
            rc = subprocess.run(cmd).returncode
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print("PASS" if rc == 0 else "FAIL: a rank failed (exit %d)" % rc)
        sys.exit(rc)
    with open(sys.argv[2]) as f:
        ref = json.load(f)
    failed = []
    with bumblebee.Trainer("configs/demo.toml", BASE + ['primitives.state="fsdp"'], library=LIB or None) as t:
        if t.world_size != 2 or t.rank != int(os.environ["OMPI_COMM_WORLD_RANK"]):
            failed.append("rank %d of %d, the launcher says %s of 2" % (t.rank, t.world_size,
                                                                      os.environ["OMPI_COMM_WORLD_RANK"]))
        got = results(t)
    for key in ("loss", "grad_norm"):
        if abs(got[key] - ref[key]) > 1e-6 * abs(ref[key]):
            failed.append("%s %r, one process %r" % (key, got[key], ref[key]))
    for key in ("logprobs", "entropy"):
        worst = max(abs(a - b) for x, y in zip(got[key], ref[key]) for a, b in zip(x, y))
        if worst > 1e-5 or [len(x) for x in got[key]] != [len(x) for x in ref[key]]:
            failed.append("%s differ by %g" % (key, worst))
    for f in failed:
        print("FAIL (rank %s): %s" % (os.environ["OMPI_COMM_WORLD_RANK"], f))
    sys.exit(1 if failed else 0)


main()
