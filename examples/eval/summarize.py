#!/usr/bin/env python3
"""Markdown tables from qevict_eval's results.csv (standard library only).

    python3 examples/eval/summarize.py OUT/results.csv > summary.md

1. Overview: top-1 agreement / KL(full || method) per method and budget (rows) and context
   (columns), mean over texts and prompts.
2. Full table: one row per text, context, method and budget, each value the mean over prompts.
"""
import csv
import math
import sys
from collections import OrderedDict


def fnum(x, fmt):
    return "–" if x is None or math.isnan(x) else fmt.format(x)


def mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def main(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k not in ("text", "method", "budget", "note"):
                try:
                    r[k] = float(v)
                except ValueError:
                    pass
    contexts = sorted({int(r["context"]) for r in rows})
    methods = list(OrderedDict.fromkeys(r["method"] for r in rows if r["method"] != "full"))
    budgets = list(OrderedDict.fromkeys(r["budget"] for r in rows if r["method"] != "full"))
    texts = list(OrderedDict.fromkeys(r["text"] for r in rows))
    prompts = len({r["prompt"] for r in rows})

    print(f"Top-1 agreement / mean KL(full ‖ method) in nats over the teacher-forced tokens; "
          f"mean over {len(texts)} text(s) × {prompts} prompt(s). 'does not fit': the budget does not hold the method's fixed parts.\n")
    print("| method | budget | " + " | ".join(f"{c} tokens" for c in contexts) + " |")
    print("|---|---|" + "---|" * len(contexts))
    for m in methods:
        for b in budgets:
            cells = []
            for c in contexts:
                sel = [r for r in rows if r["method"] == m and r["budget"] == b and int(r["context"]) == c]
                fit = [r for r in sel if r["fits"] == 1]
                if not sel:
                    cells.append(" ")
                elif len(fit) < len(sel):
                    why = "error" if sel[0]["note"].startswith("error") else "does not fit"
                    cells.append(why if not fit else f"fits {len(fit)}/{len(sel)}")
                else:
                    cells.append(f"{mean([r['top1'] for r in fit]):.3f} / {mean([r['kl'] for r in fit]):.3f}")
            print(f"| {m} | {b} | " + " | ".join(cells) + " |")
    print()

    cols = [("held/full", "used_vs_full", "{:.3f}"), ("top-1", "top1", "{:.3f}"), ("KL", "kl", "{:.4f}"),
            ("ppl ratio", "ppl_ratio", "{:.3f}"), ("FMM", "fmm", "{:.3f}"), ("FMM no-Q", "fmm_no_quant", "{:.3f}"),
            ("LIR deployed", "lir_deployed", "{:.3f}"), ("LIR oracle", "lir_oracle", "{:.3f}"),
            ("churn", "churn", "{:.4f}"), ("mass F", "mass_full", "{:.3f}"), ("mass Q", "mass_quantized", "{:.3f}"),
            ("mass E", "mass_evicted", "{:.3f}"), ("mass S+R", "mass_protected", "{:.3f}"),
            ("score cos", "score_agreement", "{:.4f}")]
    print("| text | context | method | budget | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for t in texts:
        for c in contexts:
            sel = [r for r in rows if r["text"] == t and int(r["context"]) == c and r["method"] == "full"]
            if sel:
                ppl = mean([r["ppl_method"] for r in sel])
                print(f"| {t} | {c} | full | – | 1.000 | 1.000 | 0 | 1 (ppl {ppl:.2f}) |" + " |" * (len(cols) - 4))
            for m in methods:
                for b in budgets:
                    sel = [r for r in rows if r["text"] == t and int(r["context"]) == c and r["method"] == m and r["budget"] == b]
                    if not sel:
                        continue
                    fit = [r for r in sel if r["fits"] == 1]
                    if not fit:
                        why = "error" if sel[0]["note"].startswith("error") else "does not fit"
                        print(f"| {t} | {c} | {m} | {b} | {why} |" + " |" * (len(cols) - 1))
                        continue
                    cells = [fnum(mean([r[k] for r in fit]), fmt) for _, k, fmt in cols]
                    print(f"| {t} | {c} | {m} | {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py results.csv")
    main(sys.argv[1])
