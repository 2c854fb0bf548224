"""``knapspec serve`` on the real SmolLM2-135M-Instruct (provisioned on first use): chat
requests sent together through the ``openai`` client answer exactly as each sent alone
(greedy, and sampled with a seed), and a streamed answer equals the plain one."""

from __future__ import annotations

import asyncio
import os

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need knapspec[serve,test]")
pytest.importorskip("fastapi", reason="the serve tests need knapspec[serve]")

from serve_support import running  # noqa: E402

pytestmark = [pytest.mark.real_model]

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps on.",
]


def test_real_model_answers_under_load_equal_alone() -> None:
    parallel = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
    threads = "1" if parallel else "2"
    args = ("--dtype", "float32", "--max-batch", "4", "--max-model-len", "1024")
    # The first start on a machine measures its kernels and latencies (minutes when busy).
    with running("default", *args, "--threads", threads, ready_timeout=900) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        jobs = [
            {"messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0}
            for q in QUESTIONS
        ]
        jobs.append(jobs[1] | {"temperature": 0.7, "top_p": 0.9, "seed": 7})
        alone = [
            client.chat.completions.create(model=model, **job).choices[0].message.content
            for job in jobs
        ]
        assert "Paris" in (alone[0] or "")

        async def together() -> list[str | None]:
            async_client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="none", max_retries=0
            )
            answers = await asyncio.gather(
                *(async_client.chat.completions.create(model=model, **job) for job in jobs)
            )
            return [answer.choices[0].message.content for answer in answers]

        assert asyncio.run(together()) == alone
        stream = client.chat.completions.create(model=model, stream=True, **jobs[2])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone[2]
