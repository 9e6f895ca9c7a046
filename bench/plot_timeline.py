#!/usr/bin/env python3
"""plot_timeline.py — draw Chrome trace files written by bench_train_step / bench_moe_layer
--timeline (bench/timeline.h) as one SVG (no dependencies): a panel per file, a row per stream,
emulated collectives coloured by traffic class, GEMM kernels dark grey, other work light grey.

    python3 bench/plot_timeline.py OUT.svg TRACE.json [TRACE.json ...] [--window START_MS END_MS]
        [--middle MS] [--title TEXT] [--labels LABEL ...]

--window keeps [START, END) ms of each trace; --middle MS keeps MS ms around the middle of each
(a few layers of a long step); --labels names the panels (default: each trace's own title).
Every panel shares one time axis.
"""
import argparse
import html
import json

CLASS_COLOURS = {"ep": "#d62728", "cp": "#ff7f0e", "param_gather": "#1f77b4", "grad_reduce": "#2ca02c",
                 "other": "#9467bd"}
GEMM, OTHER = "#555555", "#b8b8b8"
STREAM_ORDER = ["compute", "comm", "wgrad", "copy"]
WIDTH, LEFT, ROW, GAP, TITLE = 1200, 90, 22, 46, 18


def colour(name):
    if name.startswith("wire: "):
        return CLASS_COLOURS.get(name[6:], CLASS_COLOURS["other"])
    if any(k in name for k in ("gemm", "nvjet", "grouped", "mma", "cutlass", "sm90")):
        return GEMM
    return OTHER


def load(path, window, middle):
    d = json.load(open(path))
    title = d.get("otherData", {}).get("title", path)
    xs = [e for e in d["traceEvents"] if e.get("ph") == "X"]
    if middle and xs:
        mid = max(e["ts"] + e["dur"] for e in xs) / 2e3
        window = (mid - middle / 2, mid + middle / 2)
    names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = []
    for e in xs:
        a, b = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if window:
            if b <= window[0] or a >= window[1]:
                continue
            a, b = max(a, window[0]), min(b, window[1])
        spans.append((e["tid"], a, b, e["name"]))
    return title, names, spans, window


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("traces", nargs="+")
    p.add_argument("--window", nargs=2, type=float)
    p.add_argument("--middle", type=float)
    p.add_argument("--title", default="")
    p.add_argument("--labels", nargs="+", default=[])
    a = p.parse_args()
    panels = [load(t, a.window, a.middle) for t in a.traces]
    for i, label in enumerate(a.labels[:len(panels)]):
        panels[i] = (label,) + panels[i][1:]
    t0 = min((s[1] for _, _, spans, _ in panels for s in spans), default=0)
    t1 = max((s[2] for _, _, spans, _ in panels for s in spans), default=1)
    if panels and panels[0][3]:
        t0, t1 = panels[0][3]
    scale = (WIDTH - LEFT - 20) / max(t1 - t0, 1e-9)
    out, y = [], 30 if a.title else 10
    if a.title:
        out.append(f'<text x="10" y="20" font-size="14">{html.escape(a.title)}</text>')
    for title, names, spans, _ in panels:
        tids = sorted({s[0] for s in spans},
                      key=lambda t: (STREAM_ORDER.index(names.get(t)) if names.get(t) in STREAM_ORDER else 99, t))
        out.append(f'<text x="10" y="{y + 12}" font-size="11">{html.escape(title)}</text>')
        y += TITLE
        for i, tid in enumerate(tids):
            ry = y + i * ROW
            out.append(f'<text x="10" y="{ry + 15}" font-size="11">{html.escape(names.get(tid, str(tid)))}</text>')
            out.append(f'<rect x="{LEFT}" y="{ry}" width="{WIDTH - LEFT - 20}" height="{ROW - 4}" fill="#f4f4f4"/>')
            for t, s, e, name in spans:
                if t != tid:
                    continue
                x, w = LEFT + (s - t0) * scale, max((e - s) * scale, 0.5)
                out.append(f'<rect x="{x:.2f}" y="{ry}" width="{w:.2f}" height="{ROW - 4}" fill="{colour(name)}">'
                           f'<title>{html.escape(name)} {e - s:.3f} ms</title></rect>')
        y += len(tids) * ROW
        for k in range(6):  # time axis
            tx = t0 + (t1 - t0) * k / 5
            x = LEFT + (tx - t0) * scale
            out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="black"/>')
            out.append(f'<text x="{x:.1f}" y="{y + 16}" font-size="10" text-anchor="middle">{tx:.2f} ms</text>')
        y += GAP
    legend = [("wire: " + k, c) for k, c in CLASS_COLOURS.items()] + [("GEMM kernels", GEMM), ("other work", OTHER)]
    for i, (label, c) in enumerate(legend):
        x = 10 + i * 150
        out.append(f'<rect x="{x}" y="{y - 20}" width="12" height="12" fill="{c}"/>')
        out.append(f'<text x="{x + 16}" y="{y - 10}" font-size="11">{html.escape(label)}</text>')
    with open(a.out, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" font-family="sans-serif">\n')
        f.write('<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(out) + "\n</svg>\n")


if __name__ == "__main__":
    main()
