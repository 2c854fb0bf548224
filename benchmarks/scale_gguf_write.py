"""Step 1 of ``benchmarks/scale_gguf.py`` (knapspec's environment): per size, the GGUF
files, the prompts' ids, transformers' reference logits and greedy tokens (on the float
model, and per format on the values the file stores, read back) and the triad bandwidth,
with a JSON manifest that step 2 (llama-cpp-python's environment) reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.llamacpp_gguf import git_commit

#: Reference on the float32 model up to this size, else on the bfloat16 one.
FP32_REFERENCE_PARAMETERS = 4e9


def write(args: argparse.Namespace) -> None:
    """Step 1 (knapspec's environment): files, prompts, reference, bandwidth."""
    import torch
    from benchmarks.gguf_random import round_like_file, write_random_ggufs
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
        check = torch.tensor(prompts["check"]).unsqueeze(0)
        arrays = dict(
            zip(("logits_float", "greedy_float"), _reference(model, check, args), strict=True)
        )
        for quant in args.quants:  # transformers on what each file stores, read back
            round_like_file(model, spec, quant, layers=layers, vocab=vocab, seed=args.seed)
            arrays.update(
                zip(
                    (f"logits_{quant}", f"greedy_{quant}"),
                    _reference(model, check, args),
                    strict=True,
                )
            )
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

        np.savez(reference, **arrays)
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


def _reference(model: Any, check: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """transformers' last-position logits ``(vocab,)`` for ``check (1, n)`` and its greedy
    continuation ``(args.check_tokens,)``, as numpy arrays."""
    import torch

    with torch.inference_mode():
        logits = model(check).logits[0, -1].float().numpy()
        greedy = model.generate(
            check,
            attention_mask=torch.ones_like(check),
            do_sample=False,
            max_new_tokens=args.check_tokens,
        )[0, check.shape[1] :].numpy()
    return logits, greedy


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
