"""PyTorch peers for the decode-attention benchmark, and the table that compares them.

  python3 peers.py measure > peers.jsonl     # SDPA flash / cuDNN over the full bf16 cache, copy bandwidth
  python3 peers.py report qevict.jsonl peers.jsonl   # markdown table

One layer of Llama-3.1-8B (32 query heads, 8 KV heads, head_dim 128, bf16). GQA decode is
expressed as 4 queries per KV head attending to that head's keys (no K/V expansion), which every
SDPA back end accepts. Timing: CUDA events, L2 flushed before each run, median of 30 after 5 warm-ups.
The flush follows QEVICT_BENCH_FLUSH as decode_setup.cuh does: dirty (default: a 256 MiB fill, which
leaves L2 full of written lines) or clean (the fill, then a read of another 256 MiB).
"""
import json
import os
import sys


def flush_mode():
    mode = os.environ.get("QEVICT_BENCH_FLUSH", "dirty")
    if mode not in ("dirty", "clean"):
        sys.exit(f"QEVICT_BENCH_FLUSH must be dirty or clean, not '{mode}'")
    return mode

POINTS = [(32, 1280), (32, 8192), (32, 32768), (1, 32768), (1, 131072)]


def median_ms(fn, warmup=5, reps=30):
    import torch
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    clean = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") if flush_mode() == "clean" else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        flush.fill_(i & 0xFF)
        if clean is not None:
            clean.max()  # reads every line into L2
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def measure():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    # Device-to-device copy bandwidth, counting bytes read and written.
    n = 4 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 3, 20)
    print(json.dumps({"impl": "copy", "ms": ms, "bytes": 2 * n, "tbps": 2 * n / ms / 1e9, "flush": flush_mode()}), flush=True)
    del x, y
    torch.cuda.empty_cache()

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for batch, context in POINTS:
        k = torch.randn(batch, 8, context, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(batch, 8, 4, 128, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        for name, backend in backends.items():
            rec = {"impl": name, "batch": batch, "context": context, "bytes": kv_bytes}
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v)
                    torch.cuda.synchronize()
                    rec["ms"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v))
            except Exception as e:  # a back end that refuses the shape is reported, not fatal
                rec["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(rec), flush=True)
        del k, v, q
        torch.cuda.empty_cache()


def report(ours_path, peers_path):
    rows = [json.loads(l) for p in (ours_path, peers_path) for l in open(p) if l.startswith("{")]
    copy = next(r for r in rows if r["impl"] == "copy")
    bw = copy["tbps"]
    print(f"Measured device-to-device copy bandwidth: {bw:.2f} TB/s (bytes read + written / time).")
    print(f"L2 flush before each timed call: {copy.get('flush', 'dirty')} (QEVICT_BENCH_FLUSH).\n")
    print("| batch | context | implementation | budget | ms | ms without mass | mass cost | read [MB] | TB/s | of copy BW | cuDNN / this |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, context in POINTS:
        here = [r for r in rows if r.get("batch") == batch and r.get("context") == context]
        cudnn = next((r for r in here if r["impl"] == "sdpa_cudnn" and "ms" in r), None)
        ours = [r for r in here if r["impl"].startswith("qevict")]
        ordered = sorted(ours, key=lambda r: (-(r["budget"] or 2), r["impl"])) + [r for r in here if r not in ours]
        for r in ordered:
            if "ms" not in r:
                print(f"| {batch} | {context} | {r['impl']} | 100% | failed: {r.get('error', '?')} | | | | | | |")
                continue
            tbps = r["bytes"] / r["ms"] / 1e9
            budget = "100% (all Full)" if r in ours and r["budget"] == 0 else \
                (f"{round(r['budget'] * 100)}%" if r in ours else "100% (dense)")
            no_mass = f"{r['ms_no_mass']:.4f}" if "ms_no_mass" in r else ""
            mass_cost = f"{100 * (r['ms'] / r['ms_no_mass'] - 1):+.1f}%" if "ms_no_mass" in r else ""
            ratio = f"{cudnn['ms'] / r['ms']:.2f}x" if cudnn else ""
            print(f"| {batch} | {context} | {r['impl']} | {budget} | {r['ms']:.4f} | {no_mass} | {mass_cost} | "
                  f"{r['bytes'] / 1e6:.1f} | {tbps:.2f} | {tbps / bw:.0%} | {ratio} |")


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        measure()
    else:
        report(sys.argv[2], sys.argv[3])
