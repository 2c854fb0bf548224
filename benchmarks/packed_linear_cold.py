"""A/B of builds of the packed bf16 product with the weights cold, as a decode round reads
them: SmolLM2's 30 layers of products (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536) plus its 49152x576 LM head, every weight distinct (~270 MB, far past the caches),
at 1, 4, 8, 16 and 32 rows; milliseconds per round of products (mean of 10 rounds after 2,
the builds interleaved round by round). Each build's outputs must equal the first's bitwise.

    python benchmarks/packed_linear_cold.py OLD.c NEW.c   # csrc/row_linear.c versions

Each source is compiled with the flags knapspec's own build uses (beside a copy of
``csrc/*.h``); needs a CPU with AVX512-BF16.
"""

from __future__ import annotations

import collections
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from knapspec.model.kernels.compiled import BASE_FLAGS, compiler
from knapspec.model.kernels.row_linear import amx_pack

CSRC = Path(__file__).resolve().parents[1] / "src" / "knapspec" / "model" / "kernels" / "csrc"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gateup": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def build(source: Path, into: Path) -> ctypes._CFuncPtr:
    """Compile ``source`` as knapspec does and return its ``knapspec_packed_linear``."""
    work = into / source.stem / str(abs(hash(source)))
    work.mkdir(parents=True)
    shutil.copy(source, work / "row_linear.c")
    for header in CSRC.glob("*.h"):  # bfloat16.h, amx_tiles.h: what row_linear.c includes
        shutil.copy(header, work / header.name)
    target = work / "row_linear.so"
    cc = compiler() or "cc"
    flags = [*BASE_FLAGS, "-ffp-contract=off"]
    subprocess.run([cc, *flags, "-o", str(target), str(work / "row_linear.c"), "-lm"], check=True)
    function = ctypes.CDLL(str(target)).knapspec_packed_linear
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    return function


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        builds = {str(path): build(Path(path), Path(scratch)) for path in sys.argv[1:]}
        layers = [
            {
                name: amx_pack((torch.randn(*shape) * 0.02).bfloat16())
                for name, shape in SHAPES.items()
            }
            for _ in range(30)
        ]
        head = amx_pack((torch.randn(*HEAD) * 0.02).bfloat16())
        weights = [(name, layer[name], SHAPES[name]) for layer in layers for name in SHAPES]
        weights.append(("head", head, HEAD))
        for rows in (1, 4, 8, 16, 32):
            inputs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
            first: list[torch.Tensor] | None = None
            seconds: dict[str, collections.Counter[str]] = {
                name: collections.Counter() for name in builds
            }
            for round_index in range(12):
                for name, function in builds.items():
                    outputs = []
                    for kind, weight, (n, k) in weights:
                        out = torch.empty(rows, n, dtype=torch.bfloat16)
                        x = inputs[k]
                        started = time.perf_counter()
                        function(
                            x.data_ptr(),
                            weight.data_ptr(),
                            None,
                            out.data_ptr(),
                            rows,
                            k,
                            n,
                            k,
                            n,
                            2,
                        )
                        if round_index >= 2:
                            seconds[name][kind] += (time.perf_counter() - started) / 10
                        outputs.append(out)
                    if first is None:
                        first = outputs
                    elif round_index == 0:
                        same = all(torch.equal(a, b) for a, b in zip(first, outputs, strict=True))
                        assert same, f"{name} differs from the first build at {rows} rows"
            for name, parts in seconds.items():
                detail = " ".join(f"{kind} {value * 1e3:5.2f}" for kind, value in parts.items())
                print(f"rows {rows:2d} {name}: {sum(parts.values()) * 1e3:6.2f} ms ({detail})")


if __name__ == "__main__":
    main()
