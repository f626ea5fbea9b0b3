"""Where a decode step's time goes: the appending split-KV kernel and the combine of
search_spaces/lib/cuda_attention.py timed alone and together (with and without programmatic
dependent launch), at several knob settings (with ``merge`` "cluster" or "last" there is no
combine: "both" is the split kernel alone), against torch copies of the same bytes (the caches
read and written once: two ``copy_`` calls, and one ``copy_`` of as many bytes, as the roofline's
copy ladder times it), on one GPU, one JSON.

    python benchmarks/gpu_decode_parts.py --cases 1:4096 1:16384 --commit SHA --out parts.json
        [--knobs '{"splits": 16}' ...]

Each timing: a 256 MiB write that evicts L2 (``--flush read``: a read of it), then the call
between CUDA events on torch's stream, median of ``--repeat`` (as benchmarks/gpu_attention.py
times). GQA 32/8, head_dim 128, float16, the new token at the cache's last row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from search_spaces.lib import cuda_attention as ca  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["1:4096", "1:16384"], help="batch:cache ...")
    parser.add_argument("--knobs", action="append", default=[], help="JSON knobs; the default is always run")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--flush", choices=("write", "read"), default="write",
                        help="evict L2 before each timing with a write (as `autofuse compare`; L2 left dirty) "
                             "or a read (L2 left clean)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    import tvm
    from gpu_attention import Timer, machine, scaled_error

    timer = Timer(torch, args.repeat, args.flush)
    result = {"schema": "autofuse.gpu_decode_parts/1", "commit": args.commit, "command": " ".join(sys.argv),
              "machine": machine(torch), "flush": args.flush, "cases": []}
    hq, hkv, d = 32, 8, 128
    for case in args.cases:
        nb, smax = map(int, case.split(":"))
        length = smax  # the new token is row smax - 1
        shape = dict(batch=nb, num_heads=hq, num_kv_heads=hkv, head_dim=d, max_seq=smax)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(nb, hq, d, device="cuda", generator=gen).half()
        kn, vn = (torch.randn(nb, hkv, d, device="cuda", generator=gen).half() for _ in range(2))
        kc, vc = (torch.randn(nb, hkv, smax, d, device="cuda", generator=gen).half() for _ in range(2))
        ko, vo = torch.empty_like(kc), torch.empty_like(vc)
        k_all, v_all = kc.clone(), vc.clone()
        k_all[:, :, length - 1], v_all[:, :, length - 1] = kn, vn
        p = torch.softmax(q.float().view(nb, hkv, hq // hkv, d) @ k_all.float().transpose(-1, -2) / math.sqrt(d), -1)
        ref = (p @ v_all.float()).view(nb, hq, d)
        del p
        moved = 2 * kc.numel() * kc.element_size() * 2  # both caches, read and written
        copy = timer.measure(lambda: (ko.copy_(kc), vo.copy_(vc)))
        # one copy_ of the same bytes, as the copy ladder of `autofuse compare`'s roofline times it
        flat = torch.ones(moved // 8, device="cuda")
        flat_out = torch.empty_like(flat)
        single = timer.measure(lambda: flat_out.copy_(flat))
        del flat, flat_out
        entry = {"batch": nb, "cache": smax, "bytes_moved": moved, "copy": _brief(copy, moved),
                 "single_copy": _brief(single, moved), "configs": []}
        print(f"b{nb} c{smax}: two copies {entry['copy']['median_ms']:.4f} ms, one copy "
              f"{entry['single_copy']['median_ms']:.4f} ms {entry['single_copy']['gbps']:.0f} GB/s", flush=True)
        for knobs_text in [None, *args.knobs]:
            knobs = json.loads(knobs_text) if knobs_text else None
            try:
                _, resolved = ca.check_decode(shape, "float16", knobs, append=True)
                out = torch.full_like(q, float("nan"))
                plain = ca.decode_attention(shape, "float16", knobs, append=True, dependent=False)
                split, combine, plain_split, plain_combine = (
                    f and ca.build(f).mod[f.attrs["global_symbol"]]
                    for f in (*ca.decode_attention(shape, "float16", knobs, append=True), *plain))
                partials = () if resolved["merge"] == "cluster" else (  # (part_o, part_ml)
                    torch.empty(nb, hq, resolved["splits"], d, device="cuda"),
                    torch.empty(nb, hq, resolved["splits"], 2, device="cuda"))
                if combine is None:  # merged in a cluster or by the last split: the split kernel writes out
                    sargs = [tvm.runtime.from_dlpack(t) for t in (q, kn, vn, kc, vc, ko, vo, *partials, out)]
                    cargs = []
                    combine = plain_combine = lambda: None  # noqa: E731
                else:
                    sargs = [tvm.runtime.from_dlpack(t) for t in (q, kn, vn, kc, vc, ko, vo, *partials)]
                    cargs = [tvm.runtime.from_dlpack(t) for t in (*partials, out)]
                split(*sargs, length)
                combine(*cargs)
                torch.cuda.synchronize()
                row = {"knobs": resolved, "err": scaled_error(out, ref),
                       "caches_ok": bool(torch.equal(ko, k_all) and torch.equal(vo, v_all)),
                       "split": _brief(timer.measure(lambda: split(*sargs, length)), moved),
                       "combine": _brief(timer.measure(lambda: combine(*cargs)), 0) if cargs else None,
                       "both": _brief(timer.measure(lambda: (split(*sargs, length), combine(*cargs))), moved),
                       "both_without_dependent_launch": _brief(timer.measure(
                           lambda: (plain_split(*sargs, length), plain_combine(*cargs))), moved)}
                row["err_after_timing"] = scaled_error(out, ref)  # the last timed call's output
                for key in ("both", "both_without_dependent_launch"):
                    row[key]["pct_of_copy"] = copy["median_ms"] / row[key]["median_ms"]
                    row[key]["pct_of_single_copy"] = single["median_ms"] / row[key]["median_ms"]
            except Exception as err:  # noqa: BLE001 - one config failing must not stop the others
                row = {"knobs": knobs, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            entry["configs"].append(row)
            if "error" in row:
                print(f"  {knobs}: {row['error']}", flush=True)
            else:
                combine_ms = f"{row['combine']['median_ms']:.4f}" if row["combine"] else "none"
                print(f"  {row['knobs']}: err {row['err']:.1e} (after timing {row['err_after_timing']:.1e}) "
                      f"caches {'ok' if row['caches_ok'] else 'WRONG'} "
                      f"split {row['split']['median_ms']:.4f} combine {combine_ms} "
                      f"both {row['both']['median_ms']:.4f} ms "
                      f"({row['both']['pct_of_single_copy']:.1%} of one copy; without dependent launch "
                      f"{row['both_without_dependent_launch']['median_ms']:.4f})", flush=True)
        result["cases"].append(entry)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        del kc, vc, ko, vo, k_all, v_all
        torch.cuda.empty_cache()
    return 0


def _brief(timing: dict, moved: int) -> dict:
    row = {k: timing[k] for k in ("median_ms", "p10_ms", "p90_ms", "batched_ms")}
    if moved:
        row["gbps"] = moved / (timing["median_ms"] * 1e-3) / 1e9
    return row


if __name__ == "__main__":
    sys.exit(main())
