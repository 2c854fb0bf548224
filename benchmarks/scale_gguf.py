"""llama.cpp at the shapes of ``benchmarks/scale.py``: the same random models as GGUF files.

Two steps, because llama-cpp-python lives in its own virtual environment (no torch):

    # 1. knapspec's environment: per size, the GGUFs (F16, Q8_0, Q4_0: benchmarks/
    #    gguf_random.py), the prompts' ids, transformers' reference logits and greedy
    #    tokens (float, and per format on its stored values), and the triad bandwidth
    #    scale.py measures; a manifest per size
    python benchmarks/scale_gguf.py write --sizes Qwen3-0.6B [--layers 2] --output-dir DIR
    # 2. llama-cpp-python's environment: check each file against the reference, then time it
    <venv>/bin/python benchmarks/scale_gguf.py time --manifest DIR/<stem>.json \
        --threads 2 [--quants F16 Q8_0 Q4_0] [--no-extra-buffers]

The prompts are scale.py's: the step prompt (seed 0, ``--prompt-tokens``), the
``model.generate`` comparison's warm-up (seed 1000) and pairs (seeds 1001, ...), the
prefill lengths' ids (seed = length), each a seeded draw of the model's vocabulary.

Per file, the time step writes (appending to ``results/scale/llamacpp-<cpu>.jsonl``):

* ``check``: llama.cpp's last-position logits for the step prompt against transformers'
  on the same model with each matrix set to what the file stores, read back (correlation,
  relative RMS error, top-1, the reference's top-1 margin), and its greedy continuation
  against that model's (tokens until the first difference: random weights leave
  near-ties); a correlation below the format's threshold (:data:`MIN_CORRELATION`: a
  layout error falls far below it) fails the run (exit 1) after every file is timed. The
  correlation with the float model's logits is recorded beside it (what rounding costs);
* ``steps``: the median seconds of a one-row decode step and of 4- and 16-row batches
  with every row's logits (v(k)) after the step prompt, beside the file's own bandwidth
  floor (its tensor bytes over the triad bandwidth the write step measured, counted as
  scale.py counts; ``step_floor_ms`` leaves out an untied embedding, of which a step
  reads one row), and the median cold prefill per length;
* ``generate``: greedy decoding of ``--new-tokens`` per pair prompt after a warm-up, wall
  time with the prefill (as scale.py's), and the decode rate after the first token.

Every line records the CPU, its vector flags, the format, the shape, the llama-cpp-python
and gguf-py versions, whether llama.cpp's extra weight buffer types were on (see
``benchmarks/llamacpp_gguf.py``: off is required where they crash) and the commit. The
multi-row steps call llama-cpp-python's own batch and context objects (what its ``eval``
calls, with logits for every row).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.llamacpp_gguf import (
    add_extra_buffers_option,
    cpu_record,
    git_commit,
    without_extra_buffer_types,
)

#: Lowest correlation of llama.cpp's last-position logits with transformers' on the values
#: the file stores (read back), per format: what is left is llama.cpp's own arithmetic
#: (its 8-bit activations for Q8_0 / Q4_0 products). Random weights at two layers of
#: Qwen3-0.6B's and Llama-3.2-1B's widths gave 0.99998+ (F16) and 0.9997+ (Q8_0, Q4_0);
#: query and key rows left in transformers' order, a plausible layout error, gave 0.55 at
#: Llama-3.2-1B's widths, 0.98 at a 4-head toy. Against the float model (recorded, not
#: checked) a Q4_0 file gives about 0.9: its rounding, amplified by random layers.
MIN_CORRELATION = {"F16": 0.999, "Q8_0": 0.995, "Q4_0": 0.995}


def numpy_copy_gbps(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` GB/s of a large float32 copy split over ``threads`` threads
    (numpy releases the interpreter lock while it copies): the bandwidth at timing time,
    beside the write step's triad."""
    import numpy as np

    count = mib * 2**20 // 4
    source, target = np.ones(count, np.float32), np.zeros(count, np.float32)
    bounds = [count * i // threads for i in range(threads + 1)]

    def part(i: int) -> None:
        np.copyto(target[bounds[i] : bounds[i + 1]], source[bounds[i] : bounds[i + 1]])

    best = float("inf")
    for _ in range(repeats + 1):
        workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - start)
    return round(2 * count * 4 / best / 1e9, 2)


def _decode(llm: Any, tokens: list[int], n_past: int, *, all_logits: bool) -> None:
    """Decode ``tokens`` at positions ``n_past...`` after dropping the cache past
    ``n_past`` (what ``Llama.eval`` does, with logits for every row when asked)."""
    llm._ctx.kv_cache_seq_rm(-1, n_past, -1)
    llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=all_logits)
    llm._ctx.decode(llm._batch)


def _last_logits(llama_cpp: Any, llm: Any) -> Any:
    import numpy as np

    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def _compare(logits: Any, expected: Any) -> tuple[float, float]:
    """Correlation and relative RMS error of ``logits (vocab,)`` against ``expected``."""
    import numpy as np

    correlation = float(np.corrcoef(logits, expected)[0, 1])
    return correlation, float(np.sqrt(np.mean((logits - expected) ** 2) / np.mean(expected**2)))


def check(llama_cpp: Any, llm: Any, manifest: dict[str, Any], quant: str) -> dict[str, Any]:
    """llama.cpp's logits and greedy tokens against transformers' on the file's stored
    values (the check), and its logits against the float model's (what rounding costs)."""
    import numpy as np

    reference = np.load(manifest["reference"])
    expected = reference[f"logits_{quant}"].astype(np.float64)
    greedy = reference[f"greedy_{quant}"].tolist()
    llm.reset()
    llm.eval(manifest["prompts"]["check"])
    logits = _last_logits(llama_cpp, llm).astype(np.float64)
    correlation, rel_rms = _compare(logits, expected)
    float_correlation, float_rel_rms = _compare(logits, reference["logits_float"])
    tokens = _greedy(llm, manifest["prompts"]["check"], len(greedy))[0]
    agree = next(
        (i for i, (a, b) in enumerate(zip(tokens, greedy, strict=False)) if a != b),
        min(len(tokens), len(greedy)),
    )
    return {
        "logits_correlation": round(correlation, 6),
        "logits_rel_rms_error": round(rel_rms, 6),
        "top1_equal": int(np.argmax(logits)) == int(np.argmax(expected)),
        # The reference's lead of its first token over its second, in logit spreads: a
        # random model's near-ties, which llama.cpp's arithmetic may resolve otherwise.
        "reference_top_margin": round(
            float(np.diff(np.sort(expected)[-2:])[0] / expected.std()), 4
        ),
        "greedy_tokens": len(greedy),
        "greedy_agree_prefix": agree,
        "float_logits_correlation": round(float_correlation, 6),
        "float_logits_rel_rms_error": round(float_rel_rms, 6),
        "min_correlation": MIN_CORRELATION[quant],
        "check_passed": correlation >= MIN_CORRELATION[quant],
        "reference_dtype": manifest["reference_dtype"],
    }


def _greedy(llm: Any, ids: list[int], count: int) -> tuple[list[int], float, float]:
    """``count`` greedy tokens after ``ids`` from an empty cache: tokens, wall seconds
    (prefill included) and seconds to the first token."""
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(int(token))  # an end-of-sequence id is a token like any other here
        if len(tokens) >= count:
            break
    return tokens, time.perf_counter() - start, first


def steps(llm: Any, manifest: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Median one-row and k-row step seconds after the step prompt, and cold prefills."""
    prompt = manifest["prompts"]["check"]
    llm.reset()
    llm.eval(prompt)
    n = len(prompt)
    step = {}
    for k in sorted(set(args.widths) | {1}):  # v(k) is over the one-row step
        rows = prompt[:k]
        _decode(llm, rows, n, all_logits=True)  # warm-up
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            _decode(llm, rows, n, all_logits=True)
            samples.append(time.perf_counter() - start)
        step[k] = statistics.median(samples)
    prefill = {}
    for length, ids in manifest["prompts"]["prefill"].items():
        samples = []
        for _ in range(args.prefill_repeats):
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids)
            samples.append(time.perf_counter() - start)
        prefill[length] = round(statistics.median(samples) * 1e3, 1)
    return {
        "context": n,
        "step_ms": {str(k): round(s * 1e3, 3) for k, s in step.items()},
        "v": {str(k): round(s / step[1], 3) for k, s in step.items()},
        "prefill_ms": prefill,
    }


def time_files(args: argparse.Namespace) -> None:
    """Step 2 (llama-cpp-python's environment): check and time each file."""
    import llama_cpp

    if not args.extra_buffers:
        without_extra_buffer_types(llama_cpp)
    manifest = json.loads(args.manifest.read_text())
    cpu = cpu_record()
    slug = re.sub(r"[^a-z0-9]+", "-", cpu["host_cpu"].lower()).strip("-")
    output = args.output or Path(f"results/scale/llamacpp-{slug}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    triad = manifest["bandwidth"]["triad_gbps"]
    copy_now = numpy_copy_gbps(args.threads)
    print(f"triad (write step) {triad} GB/s; copy now {copy_now} GB/s", flush=True)
    longest = max(
        [manifest["prompt_tokens"] + max(manifest["new_tokens"], max(args.widths))]
        + [len(ids) for ids in manifest["prompts"]["prefill"].values()]
    )
    failed = False
    for quant in args.quants or list(manifest["files"]):
        entry = manifest["files"][quant]
        path = Path(entry["path"])
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=longest + 16,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_batch=512,
            verbose=False,
        )
        floor_ms = entry["tensor_bytes"] / (triad * 1e9) * 1e3
        env = {
            **cpu,
            "system": "llama.cpp",
            "llama_cpp_python": llama_cpp.__version__,
            "gguf_py": manifest["gguf_py"],
            "quant": quant,
            "quant_mix": "pure",
            "shape": manifest["shape"],
            "layers": manifest["layers"],
            "vocab": manifest["vocab"],
            "parameters": entry["parameters"],
            "random_weights": True,
            "seed": manifest["seed"],
            "gguf": path.name,
            "gguf_bytes": path.stat().st_size,
            "tensor_bytes": entry["tensor_bytes"],
            "bytes_per_weight": round(entry["tensor_bytes"] / entry["parameters"], 4),
            "triad_gbps": triad,
            "copy_gbps_at_timing": copy_now,
            "floor_ms": round(floor_ms, 6),
            # Without an untied embedding (a step reads one row of it): the tighter floor.
            "step_bytes": entry["step_bytes"],
            "step_floor_ms": round(entry["step_bytes"] / (triad * 1e9) * 1e3, 6),
            "threads": args.threads,
            "extra_buffer_types": args.extra_buffers,
            "commit": git_commit(),
            "written_commit": manifest["written_commit"],
        }
        lines = [{**env, "kind": "check", **check(llama_cpp, llm, manifest, quant)}]
        failed |= not lines[0]["check_passed"]
        timed = steps(llm, manifest, args)
        timed["step_over_floor"] = round(timed["step_ms"]["1"] / floor_ms, 3)
        lines.append({**env, "kind": "steps", **timed})
        new = manifest["new_tokens"]
        _greedy(llm, manifest["prompts"]["warmup"], new)
        for pair, ids in enumerate(manifest["prompts"]["pairs"]):
            tokens, wall, first = _greedy(llm, ids, new)
            lines.append(
                {
                    **env,
                    "kind": "generate",
                    "pair": pair,
                    "prompt_tokens": len(ids),
                    "new_tokens": len(tokens),
                    "seconds": round(wall, 4),
                    "prefill_s": round(first, 4),
                    "tokens_per_second": round(len(tokens) / wall, 3),
                    "decode_tokens_per_second": round((len(tokens) - 1) / (wall - first), 3),
                }
            )
        with output.open("a") as handle:
            for line in lines:
                handle.write(json.dumps(line) + "\n")
        summary = {k: lines[0][k] for k in ("logits_correlation", "greedy_agree_prefix")}
        rates = [line["tokens_per_second"] for line in lines[2:]]
        print(
            f"{manifest['shape']} L{manifest['layers']} {quant}: {summary}, step "
            f"{timed['step_ms']} ms (floor {floor_ms:.2f}, x{timed['step_over_floor']}), "
            f"v {timed['v']}, prefill {timed['prefill_ms']} ms, tok/s {rates}",
            flush=True,
        )
        del llm
        gc.collect()
    print(f"appended to {output}")
    if failed:
        raise SystemExit(
            "CHECK FAILED: llama.cpp's logits do not follow transformers' (a file's "
            "layout is wrong; see the 'check' lines)"
        )


def build_parser() -> argparse.ArgumentParser:
    """The command line of both steps (``write`` and ``time``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    w = sub.add_parser("write", help="GGUFs, prompts, reference (knapspec's environment)")
    w.add_argument("--sizes", nargs="+", required=True)
    w.add_argument("--layers", type=int, default=None, help="depth (default: published)")
    w.add_argument("--vocab", type=int, default=None, help="vocabulary (default: published)")
    formats = ["F16", "Q8_0", "Q4_0"]
    w.add_argument("--quants", nargs="+", default=formats, choices=formats)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-tokens", type=int, default=256)
    w.add_argument("--new-tokens", type=int, default=64)
    w.add_argument("--pairs", type=int, default=3)
    w.add_argument("--prefill-lengths", type=int, nargs="*", default=[512, 2048])
    w.add_argument("--check-tokens", type=int, default=16)
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--bandwidth-mib", type=int, default=512)
    w.add_argument("--output-dir", type=Path, required=True)
    t = sub.add_parser("time", help="check and time the files (llama-cpp-python's environment)")
    t.add_argument("--manifest", type=Path, required=True)
    t.add_argument(
        "--quants", nargs="+", default=None, choices=formats, help="default: every file written"
    )
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    t.add_argument("--repeats", type=int, default=20)
    t.add_argument("--prefill-repeats", type=int, default=2)
    t.add_argument("--output", type=Path, default=None)
    add_extra_buffers_option(t)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.step == "write":
        from benchmarks.scale_gguf_write import write

        write(args)
    else:
        time_files(args)


if __name__ == "__main__":
    main()
