"""llama.cpp at the shapes of ``benchmarks/scale.py``: the same random models as GGUF files.

Two steps, because llama-cpp-python lives in its own virtual environment (no torch):

    # 1. knapspec's environment: per size, the GGUFs (F16, Q8_0, Q4_0: benchmarks/
    #    gguf_random.py), the prompts' ids, transformers' reference logits and greedy
    #    tokens, and the triad bandwidth scale.py measures; a manifest per size
    python benchmarks/scale_gguf.py write --sizes Qwen3-0.6B [--layers 2] --output-dir DIR
    # 2. llama-cpp-python's environment: check each file against the reference, then time it
    <venv>/bin/python benchmarks/scale_gguf.py time --manifest DIR/<stem>.json \
        --threads 2 [--quants F16 Q8_0 Q4_0] [--no-extra-buffers]

The prompts are scale.py's: the step prompt (seed 0, ``--prompt-tokens``), the
``model.generate`` comparison's warm-up (seed 1000) and pairs (seeds 1001, ...), the
prefill lengths' ids (seed = length), each a seeded draw of the model's vocabulary.

Per file, the time step writes (appending to ``results/scale/llamacpp-<cpu>.jsonl``):

* ``check``: llama.cpp's last-position logits for the step prompt against transformers'
  (correlation, relative RMS error, top-1, the reference's top-1 margin) and its greedy
  continuation against transformers' (tokens until the first difference: random weights
  leave near-ties that a rounded file may break the other way); a correlation below the
  format's threshold (:data:`MIN_CORRELATION`: a layout error falls far below it) fails
  the run (exit 1) after every file is timed;
* ``steps``: the median seconds of a one-row decode step and of 4- and 16-row batches
  with every row's logits (v(k)) after the step prompt, beside the file's own bandwidth
  floor (its tensor bytes over the triad bandwidth the write step measured), and the
  median cold prefill per length;
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
from benchmarks.llamacpp_gguf import cpu_record, git_commit, without_extra_buffer_types

#: Lowest correlation of llama.cpp's last-position logits with transformers' per format.
#: Random weights amplify a file's rounding through the layers (at Qwen3-0.6B's full depth:
#: F16 about 0.999999, Q8_0 0.9995, Q4_0 0.90); query and key rows left in transformers'
#: order, a plausible layout error, gave 0.55 at Llama-3.2-1B's widths with two layers.
MIN_CORRELATION = {"F16": 0.999, "Q8_0": 0.99, "Q4_0": 0.8}
#: Reference on the float32 model up to this size, else on the bfloat16 one.
FP32_REFERENCE_PARAMETERS = 4e9


def write(args: argparse.Namespace) -> None:
    """Step 1 (knapspec's environment): files, prompts, reference, bandwidth."""
    import torch
    from benchmarks.gguf_random import write_random_ggufs
    from benchmarks.scale import random_prompt, stream_bandwidth

    from knapspec.testing.shapes import random_model, shape

    torch.set_num_threads(args.threads)
    bandwidth = stream_bandwidth(args.bandwidth_mib)
    print(f"bandwidth: {bandwidth}", flush=True)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name in args.sizes:
        spec = shape(name)
        layers = spec.layers if args.layers is None else args.layers
        vocab = spec.vocab if args.vocab is None else args.vocab
        parameters = spec.parameters(layers=layers, vocab=vocab)

        def ids(length: int, seed: int, vocab: int = vocab) -> list[int]:
            return [int(t) for t in random_prompt(vocab, length, seed)]

        prompts = {
            "check": ids(args.prompt_tokens, 0),
            "warmup": ids(args.prompt_tokens, 1000),
            "pairs": [ids(args.prompt_tokens, 1001 + pair) for pair in range(args.pairs)],
            "prefill": {str(n): ids(n, n) for n in args.prefill_lengths},
        }
        fp32 = parameters <= FP32_REFERENCE_PARAMETERS
        dtype = torch.float32 if fp32 else torch.bfloat16
        start = time.perf_counter()
        model = random_model(spec, layers=layers, vocab=vocab, dtype=dtype, seed=args.seed)
        with torch.inference_mode():
            check = torch.tensor(prompts["check"]).unsqueeze(0)
            logits = model(check).logits[0, -1].float().numpy()
            greedy = model.generate(  # type: ignore[operator]
                check,
                attention_mask=torch.ones_like(check),
                do_sample=False,
                max_new_tokens=args.check_tokens,
            )[0, check.shape[1] :].numpy()
        reference_s = time.perf_counter() - start
        del model
        gc.collect()
        start = time.perf_counter()
        files = write_random_ggufs(
            spec,
            args.output_dir,
            layers=layers,
            vocab=vocab,
            seed=args.seed,
            quants=tuple(args.quants),
        )
        write_s = time.perf_counter() - start
        stem = Path(next(iter(files.values()))["path"]).name.rsplit("-", 1)[0]
        reference = args.output_dir / f"{stem}-reference.npz"
        import numpy as np

        np.savez(reference, logits=logits, greedy=greedy)
        import gguf

        manifest = {
            "shape": spec.name,
            "family": spec.family,
            "layers": layers,
            "vocab": vocab,
            "parameters": parameters,
            "seed": args.seed,
            "source_dtype": "float32",
            "reference_dtype": str(dtype).removeprefix("torch."),
            "reference": str(reference),
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "prompts": prompts,
            "bandwidth": bandwidth,
            "files": files,
            "gguf_py": getattr(gguf, "__version__", None) or _version("gguf"),
            "written_commit": git_commit(),
            "reference_s": round(reference_s, 1),
            "write_s": round(write_s, 1),
        }
        path = args.output_dir / f"{stem}.json"
        path.write_text(json.dumps(manifest))
        print(
            f"{spec.name} L{layers}: reference {reference_s:.0f} s, files {write_s:.0f} s: {path}",
            flush=True,
        )


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


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


def check(llama_cpp: Any, llm: Any, manifest: dict[str, Any], quant: str) -> dict[str, Any]:
    """llama.cpp's logits and greedy tokens against transformers' (module docstring)."""
    import numpy as np

    reference = np.load(manifest["reference"])
    expected, greedy = reference["logits"].astype(np.float64), reference["greedy"].tolist()
    llm.reset()
    llm.eval(manifest["prompts"]["check"])
    logits = _last_logits(llama_cpp, llm).astype(np.float64)
    correlation = float(np.corrcoef(logits, expected)[0, 1])
    rel_rms = float(np.sqrt(np.mean((logits - expected) ** 2) / np.mean(expected**2)))
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
        # random model's near-ties, which a file's rounding may resolve otherwise.
        "reference_top_margin": round(
            float(np.diff(np.sort(expected)[-2:])[0] / expected.std()), 4
        ),
        "greedy_tokens": len(greedy),
        "greedy_agree_prefix": agree,
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
    for k in args.widths:
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
    w.add_argument("--quants", nargs="+", default=["F16", "Q8_0", "Q4_0"])
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
    t.add_argument("--quants", nargs="+", default=None, help="default: every file written")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    t.add_argument("--repeats", type=int, default=20)
    t.add_argument("--prefill-repeats", type=int, default=2)
    t.add_argument("--output", type=Path, default=None)
    t.add_argument(
        "--no-extra-buffers",
        dest="extra_buffers",
        action="store_false",
        help="turn off llama.cpp's repacked/AMX weight buffers (use_extra_bufts)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.step == "write":
        write(args)
    else:
        time_files(args)


if __name__ == "__main__":
    main()
