"""bumblebee from Python: the trainer an RL loop drives (skills/python-api.md).

    import bumblebee
    t = bumblebee.Trainer("configs/demo.toml", overrides=['primitives.loss="policy"', 'data.path="none"'])
    metrics = t.train_batch([{"tokens": [...], "loss_mask": [...], "advantages": 0.7,
                              "old_logprobs": [...]}, ...])
    logp, entropy = t.logprobs([{"tokens": [...]}])[0]
    for name, array in t.weights(): ...          # Hugging Face names, f32, for an inference engine

A thin layer over the C interface (src/capi/bumblebee_c.h, libbumblebee_c.so) through ctypes:
no compiled Python extension, so it loads in any CPython 3 with the library built for this
machine. Documents are dicts with the keys of a JSONL rollout record (skills/rl-data.md; "id" is
accepted and not sent: results come back in the batch's order); arrays may be lists,
array.array, numpy arrays or torch tensors (copied). Results are numpy arrays when
numpy is importable, else array.array. Errors raise bumblebee.Error with the library's message.
Under mpirun each Python process is one rank, as `bumblebee train` is.
"""

import array
import ctypes
import numbers
import os

try:  # optional: results come back as numpy arrays when it is there
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the machine
    _np = None

__all__ = ["Error", "Trainer", "load_library"]


class Error(RuntimeError):
    """An error reported by the bumblebee library (the message names the cause and the fix)."""


class _Document(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.POINTER(ctypes.c_int32)),
        ("length", ctypes.c_int64),
        ("loss_mask", ctypes.POINTER(ctypes.c_uint8)),
        ("advantages", ctypes.POINTER(ctypes.c_float)),
        ("old_logprobs", ctypes.POINTER(ctypes.c_float)),
        ("ref_logprobs", ctypes.POINTER(ctypes.c_float)),
        ("routing", ctypes.POINTER(ctypes.c_int32)),
        ("routing_layers", ctypes.c_int64),
        ("routing_topk", ctypes.c_int64),
    ]


_lib = None
_API_VERSION = 2


def _candidates():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libbumblebee_c.so")
    for build in ("build", "build-cpu", "build-dev"):
        yield os.path.join(root, build, "libbumblebee_c.so")


def load_library(path=None):
    """Loads libbumblebee_c.so: `path`, else next to this package, else the repository's
    build, build-cpu or build-dev directory. Returns the ctypes library."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    tried = [path] if path else list(_candidates())
    found = next((p for p in tried if p and os.path.exists(p)), None)
    if found is None:
        raise Error("libbumblebee_c.so not found (looked in: %s); build it with `ninja -C build bumblebee_c` "
                    "or pass library=PATH" % ", ".join(tried))
    # RTLD_GLOBAL: MPI's components, loaded later by the library, resolve against it.
    lib = ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
    c = ctypes
    sig = {
        "bb_api_version": (c.c_int, []),
        "bb_last_error": (c.c_char_p, []),
        "bb_trainer_new": (c.c_void_p, [c.c_char_p, c.POINTER(c.c_char_p), c.c_int64]),
        "bb_trainer_free": (None, [c.c_void_p]),
        "bb_step": (c.c_int64, [c.c_void_p]),
        "bb_vocab_size": (c.c_int64, [c.c_void_p]),
        "bb_rank": (c.c_int, [c.c_void_p]),
        "bb_world_size": (c.c_int, [c.c_void_p]),
        "bb_metric_names": (c.c_char_p, []),
        "bb_num_metrics": (c.c_int64, []),
        "bb_train_batch": (c.c_int, [c.c_void_p, c.POINTER(_Document), c.c_int64, c.POINTER(c.c_double)]),
        "bb_train_step": (c.c_int, [c.c_void_p, c.POINTER(c.c_double)]),
        "bb_forward_backward": (c.c_int, [c.c_void_p, c.POINTER(_Document), c.c_int64, c.POINTER(c.c_double)]),
        "bb_optim_step": (c.c_int, [c.c_void_p, c.POINTER(c.c_double)]),
        "bb_last_logits": (c.c_int, [c.c_void_p, c.POINTER(_Document), c.c_int64, c.POINTER(c.c_float)]),
        "bb_token_logprobs": (c.c_int, [c.c_void_p, c.POINTER(_Document), c.c_int64, c.c_float,
                                        c.POINTER(c.c_float), c.POINTER(c.c_float)]),
        "bb_save": (c.c_int, [c.c_void_p, c.c_char_p, c.c_char_p, c.c_int64]),
        "bb_load": (c.c_int, [c.c_void_p, c.c_char_p]),
        "bb_export_hf": (c.c_int, [c.c_void_p, c.c_char_p]),
        "bb_offload": (c.c_int, [c.c_void_p, c.POINTER(c.c_double)]),
        "bb_onload": (c.c_int, [c.c_void_p, c.POINTER(c.c_double)]),
        "bb_num_weights": (c.c_int64, [c.c_void_p]),
        "bb_weight_info": (c.c_int, [c.c_void_p, c.c_int64, c.c_char_p, c.c_int64, c.POINTER(c.c_int64),
                                     c.POINTER(c.c_int64)]),
        "bb_weight_copy": (c.c_int, [c.c_void_p, c.c_int64, c.POINTER(c.c_float)]),
        "bb_weight_copy_bf16": (c.c_int, [c.c_void_p, c.c_int64, c.POINTER(c.c_uint16)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    if lib.bb_api_version() != _API_VERSION:
        raise Error("libbumblebee_c.so at %s speaks C API %d, this module %d: rebuild one of them"
                    % (found, lib.bb_api_version(), _API_VERSION))
    _lib = lib
    return lib


def _check(rc):
    if rc != 0:
        raise Error(_lib.bb_last_error().decode("utf-8", "replace"))


def _values(x):
    """A sequence of numbers from a list, array.array, numpy array or torch tensor."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().tolist()
    elif hasattr(x, "tolist"):  # numpy
        x = x.tolist()
    return x


def _typed(x, typecode, what="an array"):
    """x as a contiguous host buffer of typecode's C type. numpy arrays and torch tensors go
    through numpy without a Python list (no copy at all for a contiguous host array of that
    dtype; a GPU tensor is copied to the host once); anything else through array.array. Values
    the C type cannot hold are an error, never wrapped or truncated."""
    if _np is not None:
        if hasattr(x, "detach"):  # torch
            x = x.detach().cpu()
            try:
                x = x.numpy()
            except TypeError:  # bfloat16 and other dtypes numpy lacks
                x = x.float().numpy()
        if isinstance(x, _np.generic):
            x = _np.asarray(x)
        if isinstance(x, _np.ndarray):
            if x.ndim == 0:
                raise Error("%s must be an array, got a scalar" % what)
            if typecode in "iB":
                if x.dtype.kind not in "iub":
                    raise Error("%s must hold integers, got %s" % (what, x.dtype))
                lo, hi = (-(2 ** 31), 2 ** 31 - 1) if typecode == "i" else (0, 255)
                if x.size and (int(x.min()) < lo or int(x.max()) > hi):
                    raise Error("%s holds %d .. %d, outside what it can be (%d .. %d)"
                                % (what, int(x.min()), int(x.max()), lo, hi))
            dt = {"i": _np.int32, "f": _np.float32, "B": _np.uint8}[typecode]
            return _np.ascontiguousarray(x.reshape(-1), dtype=dt)
    try:
        return array.array(typecode, _values(x))
    except (TypeError, OverflowError) as e:
        raise Error("%s: %s" % (what, e)) from None


def _buffer(x, typecode, n, name, i):
    a = _typed(x, typecode, "document %d: '%s'" % (i, name))
    if len(a) != n:
        raise Error("document %d: '%s' has %d entries for %d tokens" % (i, name, len(a), n))
    return a


def _out(typecode, n):
    return _np.zeros(n, dtype={"f": _np.float32, "d": _np.float64, "H": _np.uint16}[typecode]) if _np is not None \
        else array.array(typecode, bytes(array.array(typecode).itemsize * n))


def _ptr(buf, ctype):
    if _np is not None and isinstance(buf, _np.ndarray):
        return buf.ctypes.data_as(ctypes.POINTER(ctype))
    addr, _ = buf.buffer_info()
    return ctypes.cast(addr, ctypes.POINTER(ctype))


class _Docs:
    """The C documents of a batch, with the buffers they point into kept alive."""

    KEYS = {"tokens", "loss_mask", "advantages", "old_logprobs", "ref_logprobs", "routing", "id"}

    def __init__(self, docs):
        docs = list(docs)
        if not docs:
            raise Error("the batch has no document")
        self.keep = []
        self.array = (_Document * len(docs))()
        self.lengths = []
        for i, d in enumerate(docs):
            if not isinstance(d, dict):
                d = {"tokens": d}
            unknown = set(d) - self.KEYS
            if unknown:
                raise Error("document %d: unknown key(s) %s (expected %s)" % (i, sorted(unknown), sorted(self.KEYS)))
            if "tokens" not in d:
                raise Error("document %d has no 'tokens'" % i)
            tok = _typed(d["tokens"], "i", "document %d: 'tokens'" % i)
            n = len(tok)
            self.lengths.append(n)
            c = self.array[i]
            c.tokens, c.length = _ptr(tok, ctypes.c_int32), n
            self.keep.append(tok)
            if d.get("loss_mask") is not None:
                b = _buffer(d["loss_mask"], "B", n, "loss_mask", i)
                c.loss_mask = _ptr(b, ctypes.c_uint8)
                self.keep.append(b)
            for key in ("advantages", "old_logprobs", "ref_logprobs"):
                v = d.get(key)
                if v is None:
                    continue
                if isinstance(v, numbers.Real) or getattr(v, "ndim", None) == 0:
                    v = [float(v)] * n  # one advantage for the whole sequence
                b = _buffer(v, "f", n, key, i)
                setattr(c, key, _ptr(b, ctypes.c_float))
                self.keep.append(b)
            shape = getattr(d.get("routing"), "shape", None)
            if shape is not None and len(shape) == 3:  # an array [tokens, layers, top-k]
                if shape[0] != n or shape[1] == 0 or shape[2] == 0:
                    raise Error("document %d: 'routing' must be [tokens][layers][top-k] with one entry per token "
                                "(%d tokens, got shape %s)" % (i, n, tuple(shape)))
                flat = _typed(d["routing"], "i", "document %d: 'routing'" % i)
                c.routing, c.routing_layers, c.routing_topk = _ptr(flat, ctypes.c_int32), shape[1], shape[2]
                self.keep.append(flat)
            elif d.get("routing") is not None:
                r = _values(d["routing"])
                if len(r) != n or n == 0 or len(r[0]) == 0 or len(r[0][0]) == 0:
                    raise Error("document %d: 'routing' must be [tokens][layers][top-k] with one entry per token "
                                "(%d tokens, got %d entries)" % (i, n, len(r)))
                layers, topk = len(r[0]), len(r[0][0])
                for j, tok_r in enumerate(r):
                    if len(tok_r) != layers or any(len(layer) != topk for layer in tok_r):
                        raise Error("document %d: 'routing' entry %d is not %d layers x top-k %d (the shape of entry 0)"
                                    % (i, j, layers, topk))
                flat = array.array("i", (e for tok_r in r for layer in tok_r for e in layer))
                c.routing, c.routing_layers, c.routing_topk = _ptr(flat, ctypes.c_int32), layers, topk
                self.keep.append(flat)


class Trainer:
    """One rank of a training job (a run config's model, primitives, layout and optimizer).

    `config`: a run-config path or TOML text; `overrides`: "table.key=value" strings as
    `bumblebee train --set` takes. With data.path = "none" the trainer has no data source and
    every step's batch comes from train_batch()."""

    def __init__(self, config, overrides=(), library=None):
        self._lib = load_library(library)
        ov = [o.encode() for o in overrides]
        arr = (ctypes.c_char_p * max(1, len(ov)))(*ov)
        self._h = self._lib.bb_trainer_new(str(config).encode(), arr, len(ov))
        if not self._h:
            raise Error(self._lib.bb_last_error().decode("utf-8", "replace"))
        self.metric_names = self._lib.bb_metric_names().decode().split(",")

    def close(self):
        """Frees the trainer's memory now (also done when the object is collected)."""
        if getattr(self, "_h", None):
            self._lib.bb_trainer_free(self._h)
            self._h = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def step(self):
        return self._lib.bb_step(self._h)

    @property
    def vocab_size(self):
        return self._lib.bb_vocab_size(self._h)

    @property
    def rank(self):
        return self._lib.bb_rank(self._h)

    @property
    def world_size(self):
        return self._lib.bb_world_size(self._h)

    def _metrics(self, call):
        out = (ctypes.c_double * len(self.metric_names))()
        _check(call(out))
        return dict(zip(self.metric_names, list(out)))

    def train_batch(self, batch):
        """One optimizer step on `batch` (documents: dicts with a rollout record's keys): every
        document once, whole, packed into the step's micro-batches. Returns the step's metrics
        (loss, grad_norm, lr, tokens, and the policy loss's clip_frac, approx_kl, entropy,
        ratio_mean, ratio_max, ref_kl, sequences)."""
        docs = _Docs(batch)
        return self._metrics(lambda out: self._lib.bb_train_batch(self._h, docs.array, len(docs.lengths), out))

    def forward_backward(self, batch):
        """The forward and backward of one step on `batch` (as train_batch), without the update:
        the step's loss, grad_norm and policy metrics so far. optim_step() applies it; exactly one
        optim_step follows each forward_backward (gradients do not accumulate across calls)."""
        docs = _Docs(batch)
        return self._metrics(lambda out: self._lib.bb_forward_backward(self._h, docs.array, len(docs.lengths), out))

    def optim_step(self):
        """Applies the pending forward_backward (clipping, the non-finite guard, the update);
        returns the step's full metrics."""
        return self._metrics(lambda out: self._lib.bb_optim_step(self._h, out))

    def train_step(self):
        """One optimizer step on the run config's own data source."""
        return self._metrics(lambda out: self._lib.bb_train_step(self._h, out))

    def last_logits(self, docs):
        """The logits after each document's last token, [len(docs) x vocab] (forward only, one rank)."""
        d = _Docs(docs)
        V = self.vocab_size
        out = _out("f", len(d.lengths) * V)
        _check(self._lib.bb_last_logits(self._h, d.array, len(d.lengths), _ptr(out, ctypes.c_float)))
        if _np is not None:
            return out.reshape(len(d.lengths), V)
        return [out[i * V:(i + 1) * V] for i in range(len(d.lengths))]

    def logprobs(self, docs, temperature=1.0):
        """Per document: (log p(token_j | tokens < j), entropy at j), entry 0 being 0: the
        old_logprobs / ref_logprobs of a rollout record (forward only; under mpirun collective,
        every rank passing the same documents)."""
        d = _Docs(docs)
        total = sum(d.lengths)
        lp, ent = _out("f", total), _out("f", total)
        _check(self._lib.bb_token_logprobs(self._h, d.array, len(d.lengths), float(temperature),
                                           _ptr(lp, ctypes.c_float), _ptr(ent, ctypes.c_float)))
        res, at = [], 0
        for n in d.lengths:
            res.append((lp[at:at + n], ent[at:at + n]))
            at += n
        return res

    def generate(self, prompts, max_new_tokens, temperature=1.0, seed=0, stop_token=None):
        """Samples continuations of `prompts` (token lists), one new token per forward over the
        whole sequences (no KV cache): a minimal method for the small models of tests and
        examples, not an inference engine. Returns the new tokens of each prompt."""
        import math
        import random
        rng = random.Random(seed)
        seqs = [list(_values(p)) for p in prompts]
        new = [[] for _ in seqs]
        done = [False] * len(seqs)
        for _ in range(max_new_tokens):
            live = [i for i in range(len(seqs)) if not done[i]]
            if not live:
                break
            logits = self.last_logits([seqs[i] for i in live])
            for row, i in zip(logits, live):
                z = [float(x) / temperature for x in row]
                m = max(z)
                w = [math.exp(x - m) for x in z]
                tok = rng.choices(range(len(w)), weights=w)[0]
                seqs[i].append(tok)
                new[i].append(tok)
                if stop_token is not None and tok == stop_token:
                    done[i] = True
        return new

    def save(self, directory):
        """Writes a checkpoint under `directory` (collective); returns the step directory."""
        buf = ctypes.create_string_buffer(4096)
        _check(self._lib.bb_save(self._h, str(directory).encode(), buf, len(buf)))
        return buf.value.decode()

    def load(self, path):
        """Loads a checkpoint (a step directory or a checkpoint root; collective)."""
        _check(self._lib.bb_load(self._h, str(path).encode()))

    def _move(self, call):
        out = (ctypes.c_double * 4)()
        _check(call(self._h, out))
        return {"seconds": out[0], "host_bytes": int(out[1]), "allocator_live": int(out[2]),
                "device_used": int(out[3])}

    def offload(self):
        """Frees the GPU for a rollout engine: the trainer's state (values, masters, moments) goes
        to host memory, the model's device buffers and the allocator's cache are released.
        Returns {"seconds", "host_bytes", "allocator_live", "device_used"} (device_used: the
        card's memory in use afterwards, every process; -1 on the CPU). Call onload() before the
        next step."""
        return self._move(self._lib.bb_offload)

    def onload(self):
        """Brings the state back after offload(), bit for bit; returns the same keys."""
        return self._move(self._lib.bb_onload)

    def export_hf(self, directory):
        """Writes a Hugging Face model directory of the current weights (one rank)."""
        _check(self._lib.bb_export_hf(self._h, str(directory).encode()))

    def weights(self, dtype="float32"):
        """Yields (hf_name, array) for every weight: what an inference engine's weight update
        takes (one rank). dtype "float32": f32 arrays (numpy with .shape when numpy is there);
        "bfloat16": the bf16 values, as a torch.bfloat16 tensor when torch and numpy are importable, else
        their uint16 bit patterns (numpy uint16 with .shape, or array.array('H'))."""
        if dtype not in ("float32", "bfloat16"):
            raise Error("weights: dtype is 'float32' or 'bfloat16', got %r" % (dtype,))
        bf16 = dtype == "bfloat16"
        torch = None
        if bf16:
            try:
                import torch  # noqa: F401 - only for the bf16 view
            except ImportError:
                torch = None
        n = self._lib.bb_num_weights(self._h)
        if n < 0:
            _check(-1)
        name = ctypes.create_string_buffer(1024)
        shape = (ctypes.c_int64 * 8)()
        ndim = ctypes.c_int64()
        for i in range(n):
            _check(self._lib.bb_weight_info(self._h, i, name, len(name), shape, ctypes.byref(ndim)))
            dims = [shape[k] for k in range(ndim.value)]
            count = 1
            for s in dims:
                count *= s
            if bf16:
                out = _out("H", count)
                _check(self._lib.bb_weight_copy_bf16(self._h, i, _ptr(out, ctypes.c_uint16)))
                if torch is not None and _np is not None:
                    yield name.value.decode(), torch.from_numpy(out.view(_np.int16)).view(torch.bfloat16).reshape(dims)
                else:
                    yield name.value.decode(), (out.reshape(dims) if _np is not None else out)
                continue
            out = _out("f", count)
            _check(self._lib.bb_weight_copy(self._h, i, _ptr(out, ctypes.c_float)))
            yield name.value.decode(), (out.reshape(dims) if _np is not None else out)

    def weight_buckets(self, bucket_bytes=1 << 30, dtype="bfloat16"):
        """Yields lists of (hf_name, array) of about bucket_bytes each (a weight larger than a
        bucket is a bucket of its own), in weights() order: the unit an RL loop pushes to its
        inference engine per call, so that host memory holds one bucket, not the model."""
        bucket, size = [], 0
        for name, w in self.weights(dtype):
            n = w.numel() * w.element_size() if hasattr(w, "element_size") else \
                (w.nbytes if hasattr(w, "nbytes") else len(w) * w.itemsize)
            if bucket and size + n > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, w))
            size += n
        if bucket:
            yield bucket
