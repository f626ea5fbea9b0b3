"""``autofuse run``: run a library built by ``autofuse build``."""

from __future__ import annotations

from ..errors import AutofuseError
from .common import input_shape_flag, input_shapes


def add_parser(sub) -> None:
    parser = sub.add_parser("run", help="run a library built by autofuse build",
                            description="Run LIB on inputs from an .npz (arrays named as the model's inputs) "
                                        "or on seeded random inputs; print a summary, optionally save the outputs. "
                                        "--input-shape must name the shapes LIB was built for.",
                            parents=[input_shape_flag()])
    parser.set_defaults(handler=run)
    parser.add_argument("library", metavar="LIB.so")
    parser.add_argument("--inputs", default=None, metavar="X.npz")
    parser.add_argument("--save", default=None, metavar="OUT.npz", help="save the outputs")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import numpy as np

    from ..model.jobs import run_library

    _, outputs = run_library(args.library, args.inputs, args.seed, input_shapes(args.input_shape))
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} {value.dtype}, mean {float(value.mean()):.6g}, "
              f"min {float(value.min()):.6g}, max {float(value.max()):.6g}")
    if args.save:
        try:
            np.savez(args.save, **outputs)
        except OSError as err:
            raise AutofuseError(f"cannot write {args.save}: {err.strerror}") from None
        print(f"saved {args.save}")
    return 0
