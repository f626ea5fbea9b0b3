"""``autofuse build``: an ONNX model with its tuned records into a shared library, checked against onnxruntime."""

from __future__ import annotations

import sys

from ..errors import AutofuseError
from .common import (db_flag, fusion_flag, input_shape_flag, input_shapes, open_database, print_matches,
                     target_flag, target_of)


def add_parser(sub) -> None:
    build = sub.add_parser("build", help="build an ONNX model with the tuned records into a shared library",
                           description=(
        "Fuse MODEL, give every kernel its best checked record when that beats the default schedule "
        "(pattern kernels default to their template), build with relax.build, export a library that "
        "TVM's runtime loads alone (plus LIB.json describing inputs and kernels), and check the "
        "result against onnxruntime on seeded inputs (exit 1 on a mismatch)."), parents=[
        fusion_flag(), db_flag("database root (default logs); --db none builds without records"), target_flag(),
        input_shape_flag()])
    build.set_defaults(handler=run)
    build.add_argument("model", metavar="MODEL.onnx")
    build.add_argument("-o", "--output", default=None, help="library path (default out/<model>-<fusion>.so)")
    build.add_argument("--no-verify", action="store_true", help="skip the onnxruntime check")
    build.add_argument("--seed", type=int, default=0, help="seed of the verification inputs")
    build.add_argument("--cuda-graph", action="store_true",
                       help="cuda targets: capture main's kernel launches into a CUDA graph (Relax RewriteCUDAGraph)")


def run(args) -> int:
    import dataclasses
    import os

    from ..model.jobs import build_model, prepare
    from ..report import table

    target = target_of(args, need_device="cannot run or check the build")
    if args.cuda_graph and target.kind.name != "cuda":
        raise AutofuseError(f"--cuda-graph needs a cuda target, not {target.kind.name}")
    prepared = prepare(args.model, args.fusion, input_shapes(args.input_shape))
    print_matches(prepared)
    output = args.output or os.path.join("out", f"{prepared.name}-{args.fusion}.so")
    result = build_model(prepared, target, open_database(args, target, none_allowed=True), output,
                         verify=not args.no_verify, seed=args.seed, cuda_graph=args.cuda_graph)
    rows = [dataclasses.asdict(d) for d in result.decisions]
    print(table(rows, [("name", "kernel"), ("pattern", "pattern"), ("applied", "applied"), ("default", "default"),
                       ("source", "record from"),
                       ("default_ms", "default ms"), ("tuned_ms", "record ms"), ("note", "note")]))
    applied = sum(d.applied == "record" for d in result.decisions)
    print(f"{applied} of {len(result.decisions)} kernels use a tuned record; the others their default schedule")
    share = result.pattern_share
    if share:
        print(f"pattern kernels: {100 * share['flop_fraction']:.0f}% of the model's FLOPs, "
              f"{100 * share['byte_fraction']:.0f}% of its bytes ({share['pattern_flops'] / 1e6:.1f} of "
              f"{share['flops'] / 1e6:.1f} MFLOP; TVM's estimate for the kernels no pattern made)")
    written = f"library {result.library}" if result.library else f"library not written ({output} left as it was)"
    print(f"model latency {result.latency_ms:.3f} ms (median); {written}")
    if result.verified is None:
        print(f"not verified: {result.message or '--no-verify'}")
        return 0
    if not result.verified:
        print(f"autofuse build: MISMATCH against onnxruntime: max abs error {result.max_abs_err:.3g}, "
              f"scaled error {result.scaled_err:.3g} ({result.message})", file=sys.stderr)
        return 1
    print(f"matches onnxruntime: max abs error {result.max_abs_err:.2g}, scaled error {result.scaled_err:.2g}")
    return 0
