"""``docs/results.md`` and the README's headline table are generated from the raw lines in
``results/`` (``python -m knapspec.bench.results_page``), and a change to either that the
raw lines do not back fails here, as ``docs/api.md`` does in tests/test_docs.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from knapspec.bench.results_page import BEGIN, END, ROOT, headline, main, page, with_headline
from knapspec.bench.results_sources import (
    Figure,
    all_figures,
    cpu_class,
    engine_vs_generate,
    exactness_cost,
    llamacpp_runs,
)

XEON = {"host_cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx512f", "amx_bf16"]}
ZEN4 = {"host_cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}
ZEN3 = {"host_cpu": "AMD EPYC", "cpu_flags": ["avx", "avx2", "fma"]}


def test_results_page_and_readme_table_are_up_to_date() -> None:
    assert main(["--check"]) == 0, "regenerate with: python -m knapspec.bench.results_page"


def test_the_check_fails_when_a_figure_is_typed_in(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "results", tmp_path / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "docs" / "results.md")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    assert main(["--root", str(tmp_path), "--check"]) == 0
    start = readme.index(BEGIN)
    typed = readme[:start] + readme[start:].replace("x** [", "1x** [", 1)
    (tmp_path / "README.md").write_text(typed, encoding="utf-8")
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert main(["--root", str(tmp_path)]) == 0  # regenerates
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme


def test_every_headline_figure_names_cpu_dtype_and_commit() -> None:
    figures = all_figures(ROOT / "results")
    table = headline(figures).splitlines()[2:]
    assert table, "the headline quotes no figure"
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert " · " in cells[2] and cells[2].split(" · ")[1] in ("float32", "bfloat16"), row
        assert cells[3].startswith("`") and len(cells[3]) > 4, row
    assert headline(figures) in page(figures)


def test_cpu_classes_come_from_the_recorded_flags() -> None:
    assert cpu_class(XEON) == "Intel Xeon with AMX"
    assert cpu_class(ZEN4) == "AMD Zen 4"
    assert cpu_class(ZEN3) == "AMD Zen 3 / AVX2"
    assert cpu_class({"host_cpu": "AMD EPYC"}) == "CPU flags not recorded"


def _cost_line(method: str, prompt: int, wall: float, tokens: int, commit: str) -> dict:
    return {
        **ZEN3,
        "dtype": "float32",
        "commit": commit,
        "prompt_set": "long-2048",
        "prompt": prompt,
        "method": method,
        "wall_time_s": wall,
        "new_tokens": tokens,
        "command": "python benchmarks/exactness_cost.py",
    }


def test_ratios_pair_like_with_like_at_the_latest_commit(tmp_path: Path) -> None:
    lines = [
        _cost_line("default exact", 0, 1.0, 128, "old"),  # an older commit: not shown
        _cost_line("generate float32", 0, 9.0, 128, "old"),
        _cost_line("default exact", 0, 1.0, 128, "new"),
        _cost_line("generate float32", 0, 2.0, 128, "new"),
        _cost_line("default exact", 1, 1.0, 128, "new"),
        _cost_line("generate float32", 1, 3.0, 17, "new"),  # stopped at EOS: unlike
        _cost_line("default exact", 2, 0.1, 1, "new"),  # ends at once: a prefill
        _cost_line("generate float32", 2, 0.1, 1, "new"),
    ]
    (tmp_path / "exactness").mkdir()
    path = tmp_path / "exactness" / "cost-float32.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (figure,) = exactness_cost(tmp_path)
    assert figure.commit == "new"
    assert figure.values == (2.0,)
    assert figure.dropped == 2
    assert figure.cpu == "AMD Zen 3 / AVX2"


def test_the_headline_block_needs_its_markers() -> None:
    assert with_headline(f"a\n{BEGIN}\nold\n{END}\nb", "new") == f"a\n{BEGIN}\nnew\n{END}\nb"
    with pytest.raises(ValueError, match="block"):
        with_headline("no markers", "new")


def test_figure_median_and_page_spread() -> None:
    figure = Figure("b", "AMD Zen 4", "float32", "c0ffee0", "s", (1.0, 3.0, 2.0), "x", "cmd", "src")
    assert figure.median == 2.0
    assert "| s | 2.00x | 1.00x-3.00x | 3 | 0 |" in page([figure])


def test_the_serve_race_gives_rates_latency_and_paired_ratios(tmp_path: Path) -> None:
    from knapspec.bench.results_sources import serve_race

    def line(run: str, system: str, repeat: int, rate: float) -> dict:
        return {
            **ZEN3,
            "kind": "pass",
            "run": run,
            "commit": "abc1234",
            "command": "python benchmarks/serve_load.py --repeats 2",
            "dtype": "float32",
            "pass": "cold",
            "mode": "greedy",
            "concurrency": 16,
            "repeat": repeat,
            "system": system,
            "output_tokens_per_s": rate,
            "gap_p95_s": 0.1,
        }

    lines = [line("old", "knapspec", 0, 999.0), line("old", "vllm", 0, 1.0)]  # not the latest
    lines += [line("new", "knapspec", r, 150.0 / (r + 1)) for r in range(2)]
    lines += [line("new", "vllm", r, 100.0 / (r + 1)) for r in range(2)]
    lines.append({"kind": "summary", "run": "new"})  # summary lines are not read
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "race.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    figures = {f.setting: f for f in serve_race(tmp_path)}
    ratio = figures["greedy, 16 client(s): knapspec / vllm (per repeat)"]
    assert ratio.values == (1.5, 1.5) and ratio.cpu == "AMD Zen 3 / AVX2"
    assert figures["greedy, 16 client(s): vllm"].values == (100.0, 50.0)
    assert figures["greedy, 16 client(s): knapspec, chunk gap p95"].unit == "s"
    assert ratio.command.endswith("--repeats 2")
    assert "knapspec / vllm (per repeat) | **1.50x**" in headline(list(figures.values()))


def _engine_line(pair: int, generate_dtype: str, generate_s: float, tokens: int = 128) -> dict:
    return {
        **XEON,
        "model": "gemma-3-270m",
        "dtype": "bfloat16",
        "commit": "c1",
        "context": 512,
        "pair": pair,
        "generate_dtype": generate_dtype,
        "generate_s": generate_s,
        "engine_s": 8.0 + pair,
        "default_s": 4.0,
        "speedup": generate_s / (8.0 + pair),
        "default_speedup": generate_s / 4.0,
        "new_tokens": tokens,
        "generate_new_tokens": 128,
    }


def test_engine_rates_count_each_pairs_engine_calls_once(tmp_path: Path) -> None:
    # Two generate dtypes per pair: the pair's engine calls sit on both of its lines.
    lines = [
        _engine_line(0, "float32", 16.0),
        _engine_line(0, "bfloat16", 12.8),
        _engine_line(1, "float32", 16.0),
        _engine_line(1, "bfloat16", 12.8),
        _engine_line(2, "float32", 16.0, tokens=40),  # stopped early: unlike, left out
    ]
    (tmp_path / "engine").mkdir()
    path = tmp_path / "engine" / "engine_vs_generate-gemma-3-270m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rates = {
        f.setting.split(": ", 1)[1]: f for f in engine_vs_generate(tmp_path) if f.unit == "tok/s"
    }
    plain = rates["plain engine, 128 new tokens"]
    assert plain.values == (128 / 8.0, 128 / 9.0) and plain.dropped == 1
    assert rates["default decoder, 128 new tokens"].values == (32.0, 32.0)
    assert rates["model.generate bfloat16, 128 new tokens"].values == (10.0, 10.0)


def test_llamacpp_lines_give_rates_per_context_at_the_latest_commit(tmp_path: Path) -> None:
    def line(commit: str, context: int, seconds: float, tokens: int = 128) -> dict:
        return {
            **XEON,
            "system": "llama.cpp",
            "model": "gemma-3-270m",
            "gguf": "gemma-3-270m-q4_k_m.gguf",
            "llama_cpp_python": "0.3.36",
            "extra_buffer_types": False,
            "commit": commit,
            "context": context,
            "seconds": seconds,
            "new_tokens": tokens,
        }

    lines = [line("old", 512, 1.0), line("new", 512, 4.0), line("new", 512, 8.0)]
    lines += [line("new", 2048, 2.0, tokens=7)]  # ended at once: unlike, counted
    (tmp_path / "engine").mkdir()
    path = tmp_path / "engine" / "llamacpp-gemma-3-270m-q4_k_m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    short, long = llamacpp_runs(tmp_path)
    assert (short.commit, short.dtype, short.unit) == ("new", "GGUF Q4_K_M", "tok/s")
    assert short.values == (32.0, 16.0) and "extra buffers off" in short.setting
    assert long.values == (3.5,) and long.dropped == 0
