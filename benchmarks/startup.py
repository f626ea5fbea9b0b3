"""What a tuning process waits for before its first trial: importing all of TVM's tensor
intrinsics (what TuneContext does) versus registering only the CPU ones (what autofuse does for
llvm). Each measured in fresh processes, median of --repeat.

    python benchmarks/startup.py [--repeat 3]

Writes benchmarks/results/startup.json.
"""

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autofuse.report import machine_info, write_json  # noqa: E402

CASES = {
    "full tensor_intrin import (MetaSchedule default)":
        "import tvm.s_tir.tensor_intrin",
    "autofuse register_tensor_intrinsics(llvm)":
        "from autofuse.target import parse_target; from autofuse.tune import register_tensor_intrinsics;"
        " register_tensor_intrinsics(parse_target('llvm')); import tvm.s_tir.tensor_intrin",
}
PRELUDE = "import time, tvm, tvm.s_tir.meta_schedule; t = time.perf_counter(); "
EPILOGUE = "; print(time.perf_counter() - t)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for name, code in CASES.items():
        secs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, "-c", PRELUDE + code + EPILOGUE], capture_output=True,
                                 text=True, check=True, cwd=root)
            secs.append(float(out.stdout.strip().splitlines()[-1]))
        results[name] = {"median_secs": statistics.median(secs), "runs": secs}
        print(f"{name}: {statistics.median(secs):.2f} s (runs {', '.join(f'{s:.2f}' for s in secs)})")
    out = os.path.join(root, "benchmarks", "results", "startup.json")
    write_json(out, {"machine": machine_info(), "cases": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
