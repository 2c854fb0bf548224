"""``knapspec generate --prompts-file``: JSONL in, one JSON line per prompt out, in order,
each completion equal to the prompt decoded alone; bad files are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.test_cli import model_dir  # noqa: F401  (the saved tiny model fixture)

from knapspec.cli import main


def test_prompts_file_writes_one_json_line_per_prompt_in_order(
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = ['"the cat sat on"', '{"prompt": "a dog ran far and", "id": "x"}', "", '"it"']
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    common = ["generate", "--model", str(model_dir), "--max-new-tokens", "5", "--no-chat"]
    common += ["--set", "planner.name=lookup"]  # no cost model: nothing is profiled
    argv = [*common, "--prompts-file", str(prompts), "--batch-size", "2", "--output", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["id"] for r in records] == [None, "x", None]
    assert "tokens/s over the batch" in capsys.readouterr().err
    for record, text in zip(records, ["the cat sat on", "a dog ran far and", "it"], strict=True):
        assert record["stop_reason"] in ("eos", "max_new_tokens")
        assert main([*common, "--prompt", text, "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert record["completion"] == alone["completion"]
        assert record["new_tokens"] == alone["stats"]["new_tokens"]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "holds no prompts"),
        ('"a"\nnot json\n', [], "line 2: not JSON"),
        ('{"text": "a"}\n', [], 'line 1: expected a string or an object with a "prompt"'),
        ('"  "\n', [], "line 1: the prompt is empty"),
        ('"a"\n', ["--prompt", "b"], "--prompt cannot be combined with --prompts-file"),
        ('"a"\n', ["--batch-size", "0"], "--batch-size"),
    ],
)
def test_bad_prompts_files_are_usage_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    extra: list[str],
    message: str,
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content, encoding="utf-8")
    assert main(["generate", "--prompts-file", str(prompts), *extra]) == 2
    assert message in capsys.readouterr().err


def test_output_without_prompts_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "a", "--output", "x.jsonl"]) == 2
    assert "--output is for --prompts-file" in capsys.readouterr().err
