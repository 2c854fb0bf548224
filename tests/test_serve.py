"""``knapspec serve`` as a real process on 127.0.0.1, driven by the official ``openai``
client (sync and async, streamed and not) on a tiny random model (tests/serve_support.py).

One server (``--api-key``, 4 rows) takes most tests; a second one (one row, a queue of one,
plain decoding so that a long answer holds the row for seconds) sees a client disconnect,
gives the 429, and then takes SIGTERM while a stream is in flight.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need knapspec[serve,test]")
pytest.importorskip("fastapi", reason="the serve tests need knapspec[serve]")

from serve_support import WORDS, Server, running, save_tiny_model  # noqa: E402

KEY = "test-key"
MODEL = "tiny"
FLOAT32 = ("--dtype", "float32", "--served-model-name", MODEL)
PROMPTS = [
    "the cat sat on the mat",
    "a dog ran far and then it sat",
    "red sun . blue moon . big tree",
    "small bird saw the night",
    "the day and the night and the day",
    "it ran",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("serve-model"), poison=True)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with running(model_dir, *FLOAT32, "--api-key", KEY, "--max-batch", "4") as serving:
        yield serving


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    pattern = re.compile(rf"^{re.escape(name)} ([0-9.e+-]+)$", re.MULTILINE)
    found = pattern.search(text)
    return float(found.group(1)) if found else 0.0


def _error(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.body
    assert isinstance(body, dict), body
    inner = body.get("error", body)
    assert isinstance(inner, dict)
    return inner


# ---------------------------------------------------------------------------- the API
def test_models_health_and_metrics(server: Server, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as answer:
        assert json.loads(answer.read())["status"] == "ready"
    client.completions.create(model=MODEL, prompt="the cat", max_tokens=3, temperature=0)
    for name in (
        "knapspec_requests_total",
        "knapspec_generation_tokens_total",
        "knapspec_prompt_tokens_total",
        "knapspec_queue_depth",
        "knapspec_batch_size",
        "knapspec_accepted_tokens_per_step_bucket",
        "knapspec_time_to_first_token_seconds_bucket",
        "knapspec_step_seconds_bucket",
        "knapspec_prefill_seconds_bucket",
    ):
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
            assert name in answer.read().decode(), name
    assert _metric(server, "knapspec_generation_tokens_total") >= 3
    assert _metric(server, "knapspec_prefill_seconds_count") >= 1
    assert _metric(server, "knapspec_prefill_seconds_sum") > 0


def test_completion_and_chat_sync_and_streamed(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason == "length"
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 8
    assert plain.usage.prompt_tokens == len(PROMPTS[0].split())
    assert all(word in WORDS for word in choice.text.split())

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages: Any = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 10
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(parts) == chat.choices[0].message.content


def test_token_id_prompt_equals_its_text(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6, temperature=0)
    # [UNK]=0, [EOS]=1, poison=2, user, assistant, system, then WORDS: "the"=6, "cat"=8.
    ids = client.completions.create(model=MODEL, prompt=[6, 8], max_tokens=6, temperature=0)
    assert ids.choices[0].text == text.choices[0].text


def test_stop_strings_end_the_answer(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    words = full.choices[0].text.split()
    stop = words[len(words) // 2]
    expected = full.choices[0].text[: full.choices[0].text.index(stop)]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop, "zzz"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == expected
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"


def test_a_shared_prefix_is_not_prefilled_again(server: Server, client: openai.OpenAI) -> None:
    document = " ".join(WORDS * 8)  # 192 tokens, then two different questions
    before = _metric(server, "knapspec_cached_prompt_tokens_total")
    for question in ("the cat sat", "a dog ran far"):
        client.completions.create(
            model=MODEL, prompt=f"{document} {question}", max_tokens=4, temperature=0
        )
    assert _metric(server, "knapspec_cached_prompt_tokens_total") - before >= 8 * len(WORDS)


# ---------------------------------------------------------------------------- exactness
def test_answers_under_load_equal_each_request_alone(server: Server, client: openai.OpenAI) -> None:
    """Greedy and seeded sampled requests, of different lengths so that rows join and
    leave the batch mid-flight, with more requests than rows (some wait in the queue)."""
    jobs: list[dict[str, Any]] = []
    for index, prompt in enumerate(PROMPTS):
        jobs.append({"prompt": prompt, "max_tokens": 20 + 13 * index, "temperature": 0})
        jobs.append(
            {"prompt": prompt, "max_tokens": 30 + 7 * index, "temperature": 0.8, "top_p": 0.9}
            | {"seed": 100 + index}
        )
    alone = [
        client.completions.create(model=MODEL, **job).choices[0].text  # type: ignore[call-overload]
        for job in jobs
    ]

    async def together() -> list[str]:
        async_client = _async_client(server)

        async def one(job: dict[str, Any], stream: bool) -> str:
            if not stream:
                answer = await async_client.completions.create(model=MODEL, **job)
                return answer.choices[0].text
            chunks = await async_client.completions.create(model=MODEL, stream=True, **job)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        return await asyncio.gather(*(one(job, i % 2 == 0) for i, job in enumerate(jobs)))

    batch_before = _metric(server, "knapspec_step_seconds_count")
    under_load = asyncio.run(together())
    assert under_load == alone
    assert _metric(server, "knapspec_step_seconds_count") > batch_before


# ---------------------------------------------------------------------------- faults
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "the cat", "n": 2}, "n"),
        ({"prompt": "the cat", "logprobs": 2}, "logprobs"),
        ({"prompt": "the cat", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": "the cat", "temperature": 3}, "temperature"),
        ({"prompt": "the cat", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "the cat", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": " ".join(["cat"] * 1100)}, "prompt"),
        ({"prompt": [6, 99999]}, "prompt"),
        ({"prompt": "the cat", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "the cat", "extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"prompt": "the cat", "extra_body": {"top_p": 0}}, "top_p"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, **body)  # type: ignore[call-overload]
    error = _error(caught.value)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("limits", "param"),
    [
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000, "max_tokens": 3}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_a_chat_limit_that_does_not_fit_is_refused_by_its_name(
    client: openai.OpenAI, limits: dict[str, int], param: str
) -> None:
    """Either of OpenAI's two names of the limit, too large or malformed, gets a 400 naming
    the one the server read (the newer max_completion_tokens when given)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            **limits,  # type: ignore[arg-type]
        )
    error = _error(caught.value)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if limits[param] > 1:
        assert error["code"] == "context_length_exceeded", error


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    """max_tokens = 5000 does not fit a row (a 400 if it were read); the newer name is the
    limit."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_completion_tokens=3,
        max_tokens=5000,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.completion_tokens <= 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"n": 3}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_chat_fields_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            **extra,  # type: ignore[arg-type]
        )
    assert _error(caught.value)["param"] == param


def test_malformed_json_unknown_model_and_api_key(server: Server, client: openai.OpenAI) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = _post(f"{server.url}/v1/completions", b"{not json", auth)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(f"{server.url}/v1/completions", b'{"model": "tiny"}', auth)
    assert status == 400 and body["error"]["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt="the cat", max_tokens=2)
    assert _error(caught.value)["param"] == "model"
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
    status, body = _post(f"{server.url}/v1/completions", b"{}")  # no key at all
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_a_failing_request_fails_alone(server: Server, client: openai.OpenAI) -> None:
    """``poison``'s embedding is NaN: its request gets a 500; the others, running beside
    it, answer as they do alone, and the server stays up."""
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS[:3]
    ]

    async def together() -> list[Any]:
        async_client = _async_client(server)
        prompts = [PROMPTS[0], "the poison cat", PROMPTS[1], PROMPTS[2]]
        return await asyncio.gather(
            *(
                async_client.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0)
                for p in prompts
            ),
            return_exceptions=True,
        )

    first, poisoned, second, third = asyncio.run(together())
    assert isinstance(poisoned, openai.InternalServerError)
    assert "NaN" in _error(poisoned)["message"]
    assert [a.choices[0].text for a in (first, second, third)] == alone
    assert client.models.list().data[0].id == MODEL


def test_one_row_server_disconnect_429_and_sigterm_drain(tmp_path: Path) -> None:
    """One row, a queue of one, plain decoding (one token a step, so that a long answer
    holds the row for seconds on any machine):

    * a client that closes its stream frees the row (the request counts as cancelled);
    * with the row busy and one request waiting, the next gets 429 with Retry-After;
    * SIGTERM while a stream is in flight and another waits: both finish, the process
      exits 0.
    """
    model = save_tiny_model(tmp_path / "long", context=4096)
    plain = ("--set", "planner.name=autoregressive")
    server = Server(model, *FLOAT32, *plain, "--max-batch", "1", "--max-queue", "1")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        cancelled = 'knapspec_requests_total{outcome="cancelled"}'
        gone = client.completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=3000, temperature=0, stream=True
        )
        for _ in zip(range(3), gone, strict=False):
            pass
        gone.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if _metric(server, cancelled) == 1 and _metric(server, "knapspec_batch_size") == 0:
                break
            time.sleep(0.02)
        assert _metric(server, cancelled) == 1
        assert _metric(server, "knapspec_batch_size") == 0

        busy = [
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=limit,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for prompt, limit in ((PROMPTS[0], 3000), (PROMPTS[1], 20))
        ]
        received = [[next(iter(busy[0]))], []]  # the first holds the row; the second waits
        deadline = time.monotonic() + 10
        while _metric(server, "knapspec_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
        assert caught.value.response.headers.get("retry-after") == "1"
        assert _error(caught.value)["type"] == "rate_limit_error"

        server.process.send_signal(signal.SIGTERM)
        for stream, chunks, limit in zip(busy, received, (3000, 20), strict=True):
            chunks.extend(stream)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            usage = chunks[-1].usage
            assert usage is not None and usage.completion_tokens == limit
        assert server.process.wait(timeout=60) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


# ---------------------------------------------------------------------------- the command
def test_serve_refuses_a_missing_model_or_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from knapspec.cli import main

    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no such directory; give a known model" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path)]) == 2  # a directory without config.json
    assert "not a transformers model directory" in capsys.readouterr().err
    real_find_spec = importlib.util.find_spec

    def without_fastapi(name: str, *args: Any) -> Any:
        return None if name == "fastapi" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_fastapi)
    assert main(["serve"]) == 1
    assert "pip install 'knapspec[serve]'" in capsys.readouterr().err
