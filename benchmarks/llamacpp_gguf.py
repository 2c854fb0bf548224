"""llama.cpp (llama-cpp-python) on a GGUF, on the same token ids as knapspec's benchmarks.

Two steps, because llama-cpp-python lives in its own virtual environment (it needs no
torch, and its build is its own):

    # 1. in knapspec's environment: the long-input prompts of engine_vs_generate.py, as ids
    #    (and, with --write-gguf, Gemma 3 270M's GGUF as shipped, assembled and checked)
    python benchmarks/llamacpp_gguf.py prompts --model gemma-3-270m --contexts 512 2048 4096 \
        --output /tmp/prompts.json --write-gguf /tmp/gguf
    # 2. in llama-cpp-python's: greedy decoding of each prompt, prefill included
    <venv>/bin/python benchmarks/llamacpp_gguf.py time --gguf gemma-3-270m-q4_k_m.gguf \
        --prompts /tmp/prompts.json --threads 2 --new-tokens 128 --pairs 3 [--no-extra-buffers]

``--no-extra-buffers`` turns off llama.cpp's extra weight buffer types (its repacked and AMX
layouts; ``use_extra_bufts`` in ``llama_model_params``), which llama-cpp-python does not
expose: the build it compiles by default on a CPU with AMX can crash in ``llama_decode``
with them on (a KVM-hosted Xeon with ``amx_int8``), and they are off in every line that
says ``"extra_buffer_types": false``.

Each line (appended to ``results/engine/llamacpp-<gguf stem>.jsonl``) records the seconds
of one call (prefill + ``new_tokens`` greedy tokens; a call that meets an end-of-sequence
token early says so in ``new_tokens``), the prefill alone (the first token's), the CPU, its
vector flags, the llama-cpp-python version, the GGUF's name, size and sha256 and the
commit. The ids are the model's own tokenizer's (the GGUF was converted from the same
model, so the two vocabularies agree), so llama.cpp reads exactly the prompt knapspec does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any


def cpu_record() -> dict[str, Any]:
    """The CPU's name and its vector flags (what a llama.cpp build can use here)."""
    name, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"host_cpu": name, "cpu_flags": vector}


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prompts(args: argparse.Namespace) -> None:
    """Write the long-input prompts' token ids (knapspec's environment)."""
    from knapspec.bench.prompts import long_input_prompt
    from knapspec.model.loading.gemma_source import fetch_gguf
    from knapspec.model.loading.provision import load_model_and_tokenizer

    if args.write_gguf is not None:
        args.write_gguf.mkdir(parents=True, exist_ok=True)
        gguf, _ = fetch_gguf(args.write_gguf)
        print(f"wrote {gguf}")
    _, tokenizer = load_model_and_tokenizer(args.model, progress=False)
    rows = [
        {"context": c, "ids": long_input_prompt(tokenizer, c, seed=c).tolist()}
        for c in args.contexts
    ]
    args.output.write_text(json.dumps({"model": args.model, "prompts": rows}))
    print(f"wrote {len(rows)} prompts to {args.output}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def without_extra_buffer_types(llama_cpp: Any) -> None:
    """Make every model llama-cpp-python loads from now on skip the extra weight buffer
    types: ``Llama`` reads its defaults from ``llama_model_default_params`` and has no
    argument for this field."""
    bindings = llama_cpp.llama_cpp  # the ctypes module ``Llama`` calls
    defaults = bindings.llama_model_default_params

    def without() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without


def add_extra_buffers_option(parser: argparse.ArgumentParser) -> None:
    """``--no-extra-buffers`` (``args.extra_buffers``: False when given), for every step
    that loads a GGUF into llama.cpp."""
    parser.add_argument(
        "--no-extra-buffers",
        dest="extra_buffers",
        action="store_false",
        help="turn off llama.cpp's repacked/AMX weight buffers (use_extra_bufts)",
    )


def time_gguf(args: argparse.Namespace) -> None:
    """Time greedy decoding of each prompt through llama-cpp-python (its environment)."""
    import llama_cpp

    if not args.extra_buffers:
        without_extra_buffer_types(llama_cpp)
    spec = json.loads(args.prompts.read_text())
    longest = max(len(p["ids"]) for p in spec["prompts"]) + args.new_tokens + 8
    llm = llama_cpp.Llama(
        model_path=str(args.gguf),
        n_ctx=longest,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    env = {
        **cpu_record(),
        "system": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "gguf": args.gguf.name,
        "gguf_bytes": args.gguf.stat().st_size,
        "gguf_sha256": _sha256(args.gguf),
        "model": spec["model"],
        "threads": args.threads,
        "extra_buffer_types": args.extra_buffers,
        "commit": git_commit(),
    }
    output = args.output or Path(f"results/engine/llamacpp-{args.gguf.stem}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)

    def run(ids: list[int]) -> tuple[float, float, int]:
        llm.reset()
        start = time.perf_counter()
        first = None
        count = 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter() - start
            count += 1
            if token == llm.token_eos() or count >= args.new_tokens:
                break
        return time.perf_counter() - start, first or 0.0, count

    with output.open("a") as handle:
        for prompt in spec["prompts"]:
            run(prompt["ids"])  # warm-up
            seconds = []
            for pair in range(args.pairs):
                wall, prefill, count = run(prompt["ids"])
                seconds.append(wall)
                row = {
                    "context": prompt["context"],
                    "prompt_tokens": len(prompt["ids"]),
                    "pair": pair,
                    "seconds": wall,
                    "prefill_s": prefill,
                    "new_tokens": count,
                    "tokens_per_second": count / wall,
                    **env,
                }
                handle.write(json.dumps(row) + "\n")
                handle.flush()
            median = statistics.median(seconds)
            print(
                f"context {prompt['context']}: {args.gguf.name} median {median:.2f} s per "
                f"{args.new_tokens} tokens (min {min(seconds):.2f}, max {max(seconds):.2f})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prompts", help="write the prompts' ids (knapspec's environment)")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--write-gguf", type=Path, default=None, help="also assemble Gemma's GGUF here")
    t = sub.add_parser("time", help="time llama.cpp on them (llama-cpp-python's environment)")
    t.add_argument("--gguf", type=Path, required=True)
    t.add_argument("--prompts", type=Path, required=True)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--new-tokens", type=int, default=128)
    t.add_argument("--pairs", type=int, default=3)
    t.add_argument("--output", type=Path, default=None)
    add_extra_buffers_option(t)
    args = parser.parse_args()
    if args.step == "prompts":
        prompts(args)
    else:
        time_gguf(args)


if __name__ == "__main__":
    main()
