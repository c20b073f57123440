"""The decode attention op under cachelife's CUDA graphs, one fresh process per case, outside pytest.

    python -m bench.kernel_capture_check [--model llama-small] [--out DIR]

GPU runs 26 and 29 lost the pytest-xdist worker that ran
`tests/kernels/test_attention.py::test_compiled_step_captures_the_op_in_cuda_graphs[llama-small]`. Each case here
runs that test's calls in a new Python process with faulthandler on (the zoo model in fp32, the op as every
layer's attention, `cachelife.generate` twice on an enabled model): without the profiler, with torch's CPU
profiler around the first call (as the test has it), and with it and `CUDA_LAUNCH_BLOCKING=1`. Per case: the
exit code, whether both calls gave the tokens of `generate` with SDPA, the captures, and the tail of stderr.
Writes `<out>/kernel-capture-check-<model>.json`. A diagnosis, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASE = """
import contextlib, torch, cachelife
from cachelife.tools import zoo
from cachelife.integration.runtime import runtime_of
from cachelife.kernels.attention_implementation import use_decode_attention
built = zoo.build({model!r}, device="cuda")
inputs = built.inputs(2, 9, 1)
expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=24, min_new_tokens=24)
use_decode_attention(built.model)
model = cachelife.enable(built.model)
profiled = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if {profiler} else None
with profiled if profiled is not None else contextlib.nullcontext():
    first = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
torch.cuda.synchronize()
again = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
torch.cuda.synchronize()
print("RESULT", torch.equal(first, expected), torch.equal(again, expected), runtime_of(model).captures)
"""

CASES = {"no profiler": (False, "0"), "profiler": (True, "0"), "profiler, blocking launches": (True, "1")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    results = {}
    for name, (profiler, blocking) in CASES.items():
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "CUDA_LAUNCH_BLOCKING": blocking}
        code = CASE.format(model=args.model, profiler=profiler)
        command = [sys.executable, "-c", code]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results[name] = {"returncode": done.returncode, "result": lines[-1] if lines else None,
                         "stderr_tail": done.stderr[-3000:]}  # fmt: skip
        print(name, done.returncode, lines[-1] if lines else "no result", flush=True)
    out = Path(args.out) / f"kernel-capture-check-{args.model}.json"
    out.write_text(json.dumps(results, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
