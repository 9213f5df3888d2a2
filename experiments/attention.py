"""mkrt.attention against every torch SDPA backend on one GPU, in the same run.

For each shape ([B, S, Hq, D] queries, Hkv key/value heads, causal or not): checks
mkrt's output against torch's (cuDNN when it runs, else the math backend on small
shapes) and the float32 reference on small shapes, then times mkrt, torch's cuDNN,
flash and memory-efficient backends and any --variants with CUDA events in rotating
rounds (mkrt.bench.interleaved_ms: warm-up, then per round one batch of --iterations
calls of each, each round starting one further on; medians over at least --repeats
rounds), so that clock drift under load favours none of them. TFLOP/s count 4 B Hq Sq
Sk D (the visible half when causal). One row per shape: mkrt's TFLOP/s against the best
torch backend, every backend's figure in the row.

    PYTHONPATH=$PWD python3 experiments/attention.py --out experiments/results/attention.jsonl

The suite: the ring-attention issue's sweep per rank (B 4, H 16, D 128, S 768 to 12288,
causal and not), Llama-3 70B GQA (Hq 64, Hkv 8, causal), D 64, and odd lengths.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from mkrt.arrays import bfloat16  # noqa: E402
from mkrt.bench import append_jsonl, interleaved_ms, record, repeated  # noqa: E402

# (B, S, Hq, Hkv, D, causal)
SUITE = [(4, s, 16, 16, 128, c) for s in (768, 1536, 3072, 4096, 6144, 12288) for c in (False, True)]
SUITE += [(1, 8192, 64, 8, 128, True), (1, 4096, 64, 8, 128, True), (4, 4096, 16, 16, 64, False),
          (4, 4096, 16, 16, 64, True), (2, 1000, 16, 4, 128, False), (1, 3000, 8, 1, 64, True)]


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--shapes", default="suite", help="'suite' or B:S:Hq:Hkv:D:causal,...")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="",
                        help="also time these configurations: bkv128_s2_pp1, bkv128_s3_pp1_c3 (three "
                             "consumer warpgroups), bkv128_s3_pp1_c2_q0 (tiles dealt out, not claimed), ... "
                             "default (the default again, in turn), cyclic (the default without the "
                             "planned deal of causal tiles) (rows per variant in attention_variants.jsonl; such a run writes no attention.jsonl rows)")
    parser.add_argument("--out", default="", help="append JSON lines here")
    return parser.parse_args()


def shapes(text, suite=None):
    """'suite' (this script's, or `suite`) or B:S:Hq:Hkv:D:causal,... as tuples."""
    if text == "suite":
        return SUITE if suite is None else suite
    out = []
    for item in text.split(","):
        b, s, hq, hkv, d, c = item.split(":")
        out.append((int(b), int(s), int(hq), int(hkv), int(d), c in ("1", "True", "causal")))
    return out


def variant_call(variant: str, q, k, v, causal: bool, out, lse):
    """One call of mkrt.attention in another configuration: bkv128_s3_pp1, optionally _c3
    (three consumer warpgroups), then _q0 or _q1 (tiles dealt out or claimed);
    "default": the default configuration (a second copy in the rounds); "cyclic": the
    default with causal tiles dealt c, c + ctas, ... instead of by the host's plan
    (A.deal_tiles), prepared apart from the default's signature."""
    import torch

    import mkrt
    from mkrt.arrays import TorchView
    from mkrt.cuda import device_sm_count
    from mkrt.kernels import attention as A

    if variant == "default":
        return lambda: mkrt.attention(q, k, v, causal=causal, out=out, lse=lse)
    if variant == "cyclic":
        problem = A.check_operands(q.shape, k.shape, v.shape, *(TorchView(x, n).dtype for x, n in
                                   ((q, "q"), (k, "k"), (v, "v"))), causal=causal)
        spec = A.default_spec(problem.dtype, problem.head_dim, causal)
        call = A._PreparedAttention(problem, spec, q.device.index, device_sm_count(q.device.index),
                                    1.0 / math.sqrt(problem.head_dim), planned_deal=False)
        views = [TorchView(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]

        def run():
            stream = torch.cuda.current_stream().cuda_stream
            call.patch(*views, stream)
            call.launch(stream)
        return run
    values = [int(part[len(prefix):]) for part, prefix in zip(variant.split("_"), ("bkv", "s", "pp", "c", "q"))]
    options = dict(zip(("block_kv", "stages", "pingpong", "consumers", "claimed"), values))
    return lambda: mkrt.attention(q, k, v, causal=causal, out=out, lse=lse, **options)


def main():
    args = parse()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import mkrt
    from mkrt.kernels import attention as A

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    np_dtype = bfloat16 if args.dtype == "bf16" else np.dtype(np.float16)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows = []
    print(f"torch {torch.__version__}; shape | mkrt TFLOP/s | " + " | ".join(backends) + " | x best")
    for B, S, Hq, Hkv, D, causal in shapes(args.shapes):
        case = f"b{B}_s{S}_h{Hq}_kv{Hkv}_d{D}" + ("_causal" if causal else "")
        gen = torch.Generator(device="cuda").manual_seed(S * 7 + Hq)
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen)
        problem = A.check_operands(q.shape, k.shape, v.shape, np_dtype, np_dtype, np_dtype,
                                   causal=causal)
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, S, device="cuda", dtype=torch.float32)
        out.fill_(float("nan"))
        mkrt.attention(q, k, v, causal=causal, out=out, lse=lse)
        # torch wants [B, H, S, D] and repeated heads for GQA (enable_gqa where it exists)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = Hq != Hkv

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                    enable_gqa=gqa)
        expected, checked_by = None, None
        for name in ("cudnn", "flash", "efficient"):
            try:
                with sdpa_kernel(backends[name]):
                    expected = sdpa().transpose(1, 2).float()
                checked_by = name
                break
            except RuntimeError:
                continue
        error = None
        if expected is not None:
            error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
        finite = bool(torch.isfinite(out).all().item())
        ok = finite and error is not None and error < 2e-2
        # every build and backend below is timed in rotating rounds (interleaved_ms): this
        # GPU's clocks drift down under sustained load, so whatever is timed first gains
        # (until 6885d2f mkrt was timed first, then each torch backend, then the variants)
        calls = {"mkrt": repeated(lambda: mkrt.attention(q, k, v, causal=causal, out=out, lse=lse),
                                  args.iterations)}
        for name, backend in backends.items():
            try:
                with sdpa_kernel(backend):
                    sdpa()
                calls[name] = repeated(sdpa, args.iterations, lambda backend=backend: sdpa_kernel(backend))
            except RuntimeError:
                pass
        variant_errors = {}
        for variant in filter(None, args.variants.split(",")):
            if variant in calls:        # "default" or "cyclic" twice: each timed once, in the rounds
                continue
            try:
                check = torch.full_like(q, float("nan"))
                run = variant_call(variant, q, k, v, causal, check, lse)
                run()
                variant_errors[variant] = ((check.float() - expected).abs().max() / expected.abs().max()).item() \
                    if expected is not None else None
                run = variant_call(variant, q, k, v, causal, out, lse)
            except Exception as error_:          # a configuration that does not fit
                print(f"  {variant}: {type(error_).__name__}: {str(error_)[:120]}")
                continue
            calls[variant] = repeated(run, args.iterations)
        rounds = max(args.repeats, len(calls))      # every call leads at least one round
        ms_of = {name: t / args.iterations for name, t in
                 interleaved_ms(calls, iterations=1, rounds=rounds, warmup=args.warmup).items()}
        ms = ms_of["mkrt"]
        tflops = problem.flops / ms / 1e9
        theirs = {name: (problem.flops / ms_of[name] / 1e9 if name in ms_of else None) for name in backends}
        for variant, variant_error in variant_errors.items():
            variant_ms = ms_of[variant]
            vrow = record("attention_variants", f"{case}_{variant}", "tflops",
                          problem.flops / variant_ms / 1e9, tflops, "TFLOP/s", ms=variant_ms,
                          variant=variant, max_rel_error=variant_error, timing="interleaved_ms medians",
                          correct=variant_error is not None and variant_error < 2e-2)
            print(f"  {variant}: {vrow['value']:.0f} TFLOP/s ({vrow['ratio']:.3f}x default) "
                  f"err {variant_error}")
            if args.out:
                append_jsonl(args.out.replace("attention.jsonl", "attention_variants.jsonl"), [vrow])
        best = max((t for t in theirs.values() if t), default=None)
        best_name = max((n for n in theirs if theirs[n]), key=lambda n: theirs[n], default=None)
        row = record("attention", case, "tflops", tflops, best, "TFLOP/s", ms=ms,
                     best_backend=best_name, backends=theirs, correct=ok, max_rel_error=error,
                     checked_against=checked_by, torch=torch.__version__, dtype=args.dtype,
                     causal=causal, timing="interleaved_ms medians")
        rows.append(row)
        cells = " | ".join("-" if t is None else f"{t:.0f}" for t in theirs.values())
        ratio = f"{row['ratio']:.3f}" if row["ratio"] else "-"
        print(f"{case} | {tflops:.0f} | {cells} | {ratio} {'ok' if ok else 'WRONG'} "
              f"(err {error if error is None else round(error, 5)})", flush=True)
        if args.out and not variant_errors:
            # a run of variants writes only their rows (each against the default of its
            # rounds): its few cases would otherwise replace the suite's line in the report
            append_jsonl(args.out, [row])
        torch.cuda.empty_cache()
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    if ratios:
        print(f"geomean x best torch backend: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}; "
              f"min {min(ratios):.3f}; wrong: {sum(not r['correct'] for r in rows)}")


if __name__ == "__main__":
    main()
