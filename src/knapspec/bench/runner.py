"""The benchmark harness: interleaved AR/method pairs, losslessness checks, raw results.

Protocol, per scenario, prompt length and prompt:

* one process, ``torch.set_num_threads`` fixed and recorded; every decoder is built once
  per method before anything is timed (set-up reported in ``setup.jsonl``);
* a warm-up call of every method on a set-up prompt outside the measured set;
* ``pairs`` rounds; in each, the calls run as ``AR, m1, AR, m2, ..., AR, mk, AR`` (the
  method order reversed every other round). Method ``mi`` is paired with the AR calls just
  before and after it: its speedup for the round is its tokens/s over their mean. Sharing
  each AR call between two neighbours keeps the pairing while halving AR's cost;
* the whole ``generate`` call is timed (prefill, planning, drafting, verifying);
* greedy scenarios: every call's tokens must equal the AR reference's, or
  :class:`~knapspec.bench.records.LosslessnessError` is raised and the run is marked
  failed;
* after the timed calls of a prompt length: the oracle frontier on the first prompt's AR
  continuation and the v(k) curves at that length (analysis, never timed against methods).

Size: over 450 lines because the timing protocol (interleaving, warm-up, the losslessness
check, set-up outside the timed calls) is one loop that reads best in one place; records,
scenarios, methods, the oracle and the report are separate modules.
"""

from __future__ import annotations

import importlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm.auto import tqdm

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.methods import (
    REFERENCE,
    MethodSpec,
    SupportsGenerate,
    forget_earlier_calls,
    freeze_first_plan,
    method_config,
)
from knapspec.bench.oracle import LookupProposer, OracleOptions, oracle_frontier
from knapspec.bench.records import (
    FAILED_RAW,
    ORACLE,
    RAW,
    RUN_INFO,
    SETUP,
    THROUGHPUT,
    VCURVE,
    LosslessnessError,
    RunRecord,
    append_jsonl,
)
from knapspec.bench.scenarios import BenchPrompt, Scenario
from knapspec.bench.throughput import run_throughput, scenario_methods, throughput_units
from knapspec.bench.timing import engine_verify_seconds, filled_cache, hf_verify_seconds
from knapspec.config import DecoderConfig
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.sampling import SamplingParams


def _scenario_tuple(values: Iterable[Scenario]) -> tuple[Scenario, ...]:
    return tuple(values)


def _method_tuple(values: Iterable[MethodSpec]) -> tuple[MethodSpec, ...]:
    return tuple(values)


@attrs.frozen
class BenchOptions:
    """What to run and where to write it.

    Attributes:
        scenarios, methods: what to benchmark (the AR reference must be among the methods).
        prompts: prompts per scenario and length; pairs: pair rounds per prompt.
        threads: ``torch.set_num_threads`` for the whole run.
        output_dir: parent of the run directory; run_name: its name.
        base_config: decoder config every method's overrides are merged into.
        oracle: frontier settings, or None to skip the oracle.
        vcurve: measure v(k) through the engine and the HF forward at each length.
        vcurve_repeats: timed repeats per v(k) point.
        warmup_tokens: new tokens of each warm-up call.
        progress: show a tqdm bar with ETA.
        command: the command line that started the run (recorded).
        overwrite: replace an existing run directory's results.
    """

    scenarios: tuple[Scenario, ...] = attrs.field(converter=_scenario_tuple)
    methods: tuple[MethodSpec, ...] = attrs.field(converter=_method_tuple)
    prompts: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    pairs: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    threads: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    output_dir: Path = Path("results/bench")
    run_name: str = "default"
    base_config: DecoderConfig = attrs.field(factory=DecoderConfig)
    oracle: OracleOptions | None = attrs.field(factory=OracleOptions)
    vcurve: bool = True
    vcurve_repeats: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    warmup_tokens: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    progress: bool = True
    command: str = ""
    overwrite: bool = False

    def __attrs_post_init__(self) -> None:
        names = [method.name for method in self.methods]
        if REFERENCE not in names:
            raise ValueError(f"the methods must include the AR reference {REFERENCE!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"method names must be unique, got {names}")
        if not self.scenarios:
            raise ValueError("no scenario to run")

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_name


@attrs.frozen
class _Call:
    """Tokens and stats of one timed call."""

    tokens: torch.Tensor
    record: dict[str, Any]


def _eos_ids(model: Any) -> list[int] | None:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return None
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def lookup_drafter_factory() -> Callable[[], LookupProposer] | None:
    """Builds the prompt-lookup drafter the ``lookup`` planner uses, for the oracle's lookup
    family (None where this installation has no lookup drafter)."""
    try:
        module = importlib.import_module("knapspec.drafters.lookup")
    except ImportError:
        return None
    factory: Callable[[], LookupProposer] = module.LookupDrafter
    return factory


def _plain(value: Any) -> Any:
    return attrs.asdict(value) if attrs.has(type(value)) else value


class Harness:
    """Runs :class:`BenchOptions` on one loaded model (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, options: BenchOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        start = time.perf_counter()
        self.engine = SublayerEngine(model)  # measures this machine's kernel table once
        self.engine_seconds = time.perf_counter() - start
        self.eos = _eos_ids(model)
        self.run_dir = options.run_dir
        self.env = {**environment(model, options.threads), **kernel_record(self.engine)}
        self.decoders: dict[str, SupportsGenerate] = {}
        self.bar: Any = None

    # ------------------------------------------------------------------ files
    def _prepare_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = [
            self.run_dir / name for name in (RAW, FAILED_RAW, SETUP, ORACLE, VCURVE, THROUGHPUT)
        ]
        if any(path.exists() for path in existing):
            if not self.options.overwrite:
                raise FileExistsError(
                    f"{self.run_dir} already holds results; pick another --run-name or pass "
                    "--overwrite"
                )
            for path in existing:
                path.unlink(missing_ok=True)
        self._write_info(status="running")

    def _write_info(self, status: str, **extra: Any) -> None:
        options = self.options
        info = {
            "run_name": options.run_name,
            "status": status,
            "command": options.command,
            "environment": self.env,
            "threads": options.threads,
            "prompts": options.prompts,
            "pairs": options.pairs,
            "warmup_tokens": options.warmup_tokens,
            "scenarios": [
                {**attrs.asdict(s, recurse=False), "sampling": attrs.asdict(s.sampling)}
                for s in options.scenarios
            ],
            "methods": [
                {
                    "name": m.name,
                    "kind": m.kind,
                    "description": m.description,
                    "generate_kwargs": dict(m.generate_kwargs) or None,
                    "freeze_plan": m.freeze_plan,
                    "config": (
                        method_config(options.base_config, m.config).to_dict()
                        if m.kind == "engine"
                        else None
                    ),
                }
                for m in options.methods
            ],
            "oracle": attrs.asdict(options.oracle) if options.oracle is not None else None,
            "base_config": options.base_config.to_dict(),
            **extra,
        }
        (self.run_dir / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    def record_extra(self) -> dict[str, Any]:
        """The fields every raw record of this run carries (run name, environment)."""
        return {"run_name": self.options.run_name, "env": self.env}

    # ------------------------------------------------------------------ set-up
    def _build_methods(self) -> None:
        for method in self.options.methods:
            if method.kind == "generate":
                continue
            config = method_config(self.options.base_config, method.config)
            start = time.perf_counter()
            decoder = method.factory(self.engine, config)
            seconds = time.perf_counter() - start
            self.decoders[method.name] = decoder
            self._setup_line(method.name, "build", seconds, config=config.to_dict())

    def _setup_line(self, method: str, kind: str, seconds: float, **extra: Any) -> None:
        line = {"method": method, "kind": kind, "seconds": seconds, **extra}
        append_jsonl(self.run_dir / SETUP, json.dumps({**line, "run_name": self.options.run_name}))

    def _freeze_plans(self, scenario: Scenario) -> None:
        """Static baselines: run the search planner on the set-up prompt, freeze its plan."""
        prompt = scenario.setup_prompt(self.tokenizer, scenario.contexts[0])
        for method in scenario_methods(scenario, self.options.methods):
            if not method.freeze_plan:
                continue
            decoder = self.decoders[method.name]
            if not isinstance(decoder, SpeculativeDecoder):
                raise TypeError(f"{method.name}: freeze_plan needs a SpeculativeDecoder")
            # A fresh searcher per scenario: what earlier scenarios taught the timed
            # decoder's online cost model must not change the frozen plan.
            start = time.perf_counter()
            searcher = method.factory(
                self.engine, method_config(self.options.base_config, method.config)
            )
            if not isinstance(searcher, SpeculativeDecoder):
                raise TypeError(f"{method.name}: freeze_plan needs a SpeculativeDecoder")
            result = searcher.generate(
                prompt.input_ids,
                max_new_tokens=min(scenario.new_tokens, 32),
                eos_token_id=self.eos,
                sampling=scenario.sampling,
            )
            try:
                frozen = freeze_first_plan(searcher, result)
            except RuntimeError as error:
                raise RuntimeError(f"{method.name} on {scenario.name}: {error}") from error
            decoder.planner = frozen
            self._setup_line(
                method.name,
                "freeze",
                time.perf_counter() - start,
                scenario=scenario.name,
                skipped_items=list(frozen.mask.skipped),
                draft_length=frozen.draft_length,
            )

    # ------------------------------------------------------------------ calls
    def _call(
        self, method: MethodSpec, prompt: BenchPrompt, new_tokens: int, sampling: SamplingParams
    ) -> _Call:
        ids = prompt.input_ids
        if method.kind == "generate":
            return self._call_generate(ids, new_tokens, sampling, method.generate_kwargs)
        decoder = self.decoders[method.name]
        forget_earlier_calls(decoder)
        result = decoder.generate(
            ids, max_new_tokens=new_tokens, eos_token_id=self._stop_ids(sampling), sampling=sampling
        )
        stats = result.stats
        return _Call(
            tokens=result.tokens.cpu(),
            record=dict(
                new_tokens=stats.new_tokens,
                wall_time=stats.wall_time_s,
                accept_lengths=list(stats.accept_lengths),
                decoding_steps=stats.decoding_steps,
                tokens_per_second=stats.tokens_per_second,
                acceptance_rate=stats.acceptance_rate,
                mean_accepted_length=stats.mean_accepted_length,
                drafted_tokens=stats.drafted_tokens,
                accepted_tokens=stats.accepted_tokens,
                prefill_seconds=stats.prefill_time_s,
                plan_seconds=stats.plan_time_s,
                draft_seconds=stats.draft_time_s,
                verify_seconds=stats.verify_time_s,
                plans=[_plain(plan) for plan in stats.plans],
                lookup_seconds=float(getattr(stats, "lookup_time_s", 0.0)),
                drafters={
                    name: _plain(counts) for name, counts in getattr(stats, "drafters", {}).items()
                },
            ),
        )

    def _stop_ids(self, sampling: SamplingParams) -> list[int] | None:
        """Greedy calls stop at EOS (every method's output is AR's, so lengths agree);
        sampled calls never stop early: methods sample different texts, and one that hit
        EOS after 13 tokens would compare a prefill-dominated time with full-length ones."""
        return None if sampling.do_sample else self.eos

    @torch.inference_mode()
    def _call_generate(
        self,
        ids: torch.Tensor,
        new_tokens: int,
        sampling: SamplingParams,
        extra: Mapping[str, Any] | None = None,
    ) -> _Call:
        """``model.generate`` as users call it: greedy (or the scenario's sampling, then
        exactly ``new_tokens`` tokens, like every other method: see :meth:`_stop_ids`),
        with the method's ``extra`` keyword arguments (e.g. prompt lookup)."""
        batch = ids.unsqueeze(0).to(self.engine.device)
        kwargs: dict[str, Any] = {
            **(extra or {}),
            "attention_mask": torch.ones_like(batch),
            "max_new_tokens": new_tokens,
            "do_sample": sampling.do_sample,
        }
        if sampling.do_sample:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
            kwargs["top_k"] = sampling.top_k or None
            kwargs["min_new_tokens"] = new_tokens
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        start = time.perf_counter()
        output = self.model.generate(batch, **kwargs)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        wall = time.perf_counter() - start
        tokens = output[0, batch.shape[1] :].cpu()
        count = int(tokens.numel())
        return _Call(
            tokens=tokens,
            record=dict(
                new_tokens=count,
                wall_time=wall,
                # As the decoder counts them: the first token comes from prefill, then one
                # verify-free step per token.
                accept_lengths=[1] * max(0, count - 1),
                decoding_steps=max(0, count - 1),
                tokens_per_second=count / wall if wall > 0 else 0.0,
                acceptance_rate=0.0,
                mean_accepted_length=1.0 if count else 0.0,
                drafted_tokens=0,
                accepted_tokens=0,
                prefill_seconds=0.0,
                plan_seconds=0.0,
                draft_seconds=0.0,
                verify_seconds=0.0,
                plans=[],
            ),
        )

    def _check_lossless(
        self, method: str, prompt: BenchPrompt, reference: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        if torch.equal(reference, tokens):
            return
        length = min(reference.numel(), tokens.numel())
        differs = (reference[:length] != tokens[:length]).nonzero()
        first = int(differs[0]) if differs.numel() else length
        raise LosslessnessError(
            f"LOSSLESSNESS FAILURE: method {method!r} on prompt {prompt.prompt_id} produced "
            f"{tokens.numel()} tokens that differ from plain decoding's {reference.numel()} "
            f"at position {first} (AR {reference[first : first + 5].tolist()} vs "
            f"{tokens[first : first + 5].tolist()}); a greedy method must reproduce AR exactly"
        )

    # ------------------------------------------------------------------ the run
    def _work_units(self) -> int:
        options, total = self.options, 0
        for scenario in options.scenarios:
            methods = len(scenario_methods(scenario, options.methods))
            if scenario.throughput:
                units = throughput_units(scenario, methods, options.pairs, options.warmup_tokens)
                total += units * len(scenario.contexts)
                continue
            calls_per_pair = 2 * (methods - 1) + 1
            per_context = options.prompts * options.pairs * calls_per_pair * scenario.new_tokens
            per_context += methods * options.warmup_tokens
            per_context += self._analysis_units(scenario)
            total += per_context * len(scenario.contexts)
        return total

    def _analysis_units(self, scenario: Scenario) -> int:
        """Rough cost of the oracle and v(k) at one length, in generated-token units."""
        units = 0
        if self.options.oracle is not None:
            units += 8 * scenario.new_tokens
        if self.options.vcurve:
            units += 2 * scenario.new_tokens
        return units

    def run(self) -> Path:
        """Run everything; returns the run directory.

        Raises:
            LosslessnessError: a greedy method's tokens differ from AR's.
        """
        torch.set_num_threads(self.options.threads)
        self._prepare_dir()
        # Which kernels the engine runs on this machine (and how long choosing them took).
        self._setup_line(
            "engine", "kernels", self.engine_seconds, kernel_table=self.engine.kernels.to_dict()
        )
        self.bar = tqdm(
            total=self._work_units(),
            unit="tok",
            disable=not self.options.progress,
            desc="set-up",
            dynamic_ncols=True,
        )
        try:
            self._build_methods()
            measured_lengths: set[int] = set()
            for scenario in self.options.scenarios:
                self._freeze_plans(scenario)
                for context in scenario.contexts:
                    if scenario.throughput:
                        run_throughput(self, scenario, context)
                    else:
                        self._run_context(scenario, context, measured_lengths)
        except LosslessnessError as error:
            raw = self.run_dir / RAW
            if raw.exists():
                raw.rename(self.run_dir / FAILED_RAW)
            else:  # the marker that keeps any report from being drawn from this run
                (self.run_dir / FAILED_RAW).touch()
            self._write_info(status="failed", error=str(error))
            raise
        except BaseException as error:
            self._write_info(status="interrupted", error=f"{type(error).__name__}: {error}")
            raise
        finally:
            self.bar.close()
        self._write_info(status="completed")
        return self.run_dir

    def _run_context(self, scenario: Scenario, context: int, measured: set[int]) -> None:
        options = self.options
        bar = self.bar
        prompts = scenario.prompts(self.tokenizer, context, options.prompts)
        bar.set_description(f"{scenario.name} N={context} warm-up")
        warm = scenario.setup_prompt(self.tokenizer, context)
        methods = scenario_methods(scenario, options.methods)
        for method in methods:
            self._call(method, warm, options.warmup_tokens, scenario.sampling)
            bar.update(options.warmup_tokens)

        others = [m for m in methods if m.name != REFERENCE]
        reference_method = next(m for m in methods if m.name == REFERENCE)
        first_reference: torch.Tensor | None = None
        for prompt in prompts:
            reference_tokens: torch.Tensor | None = None
            for pair in range(options.pairs):
                bar.set_description(
                    f"{scenario.name} N={context} prompt {prompt.index + 1}/{len(prompts)} "
                    f"pair {pair + 1}/{options.pairs}"
                )
                order = others if pair % 2 == 0 else others[::-1]
                seed = 1000 * pair + prompt.index
                sampling = (
                    attrs.evolve(scenario.sampling, seed=seed)
                    if not scenario.greedy
                    else scenario.sampling
                )
                position = 0
                previous = self._call(reference_method, prompt, scenario.new_tokens, sampling)
                if reference_tokens is None:
                    reference_tokens = previous.tokens
                self._emit_reference(scenario, prompt, pair, position, previous, seed)
                for method in order:
                    call = self._call(method, prompt, scenario.new_tokens, sampling)
                    nxt = self._call(reference_method, prompt, scenario.new_tokens, sampling)
                    lossless = None
                    if scenario.greedy:
                        self._check_lossless(REFERENCE, prompt, reference_tokens, nxt.tokens)
                        self._check_lossless(method.name, prompt, reference_tokens, call.tokens)
                        lossless = True
                    reference_tps = 0.5 * (
                        previous.record["tokens_per_second"] + nxt.record["tokens_per_second"]
                    )
                    speedup = call.record["tokens_per_second"] / reference_tps
                    record = RunRecord(
                        scenario=scenario.name,
                        method=method.name,
                        role="method",
                        prompt_id=prompt.prompt_id,
                        pair=pair,
                        position=position + 1,
                        context=context,
                        context_length=prompt.context_length,
                        sampling=attrs.asdict(scenario.sampling),
                        seed=seed if not scenario.greedy else None,
                        reference_tokens_per_second=reference_tps,
                        speedup_vs_ar=speedup,
                        lossless=lossless,
                        **call.record,
                    )
                    append_jsonl(self.run_dir / RAW, record.to_json(self.record_extra()))
                    position += 2
                    self._emit_reference(scenario, prompt, pair, position, nxt, seed)
                    previous = nxt
                    bar.update(2 * scenario.new_tokens)
                bar.update(scenario.new_tokens)
            if first_reference is None:
                first_reference = reference_tokens
        assert first_reference is not None
        self._analyse(scenario, context, prompts[0], first_reference, measured)

    def _emit_reference(
        self,
        scenario: Scenario,
        prompt: BenchPrompt,
        pair: int,
        position: int,
        call: _Call,
        seed: int,
    ) -> None:
        record = RunRecord(
            scenario=scenario.name,
            method=REFERENCE,
            role="reference",
            prompt_id=prompt.prompt_id,
            pair=pair,
            position=position,
            context=prompt.context,
            context_length=prompt.context_length,
            sampling=attrs.asdict(scenario.sampling),
            seed=seed if not scenario.greedy else None,
            lossless=True if scenario.greedy else None,
            **call.record,
        )
        append_jsonl(self.run_dir / RAW, record.to_json(self.record_extra()))

    # ------------------------------------------------------------------ analysis
    def _analyse(
        self,
        scenario: Scenario,
        context: int,
        prompt: BenchPrompt,
        continuation: torch.Tensor,
        measured: set[int],
    ) -> None:
        options, bar = self.options, self.bar
        base = {"run_name": options.run_name, "scenario": scenario.name, "context": context}
        if options.oracle is not None and continuation.numel() >= 2:
            bar.set_description(f"{scenario.name} N={context} oracle")
            start = time.perf_counter()
            result = oracle_frontier(
                self.engine,
                prompt.input_ids,
                continuation,
                options.oracle,
                lookup=lookup_drafter_factory() if options.oracle.lookup else None,
            )
            line = {
                **base,
                "prompt_id": prompt.prompt_id,
                "seconds": time.perf_counter() - start,
                **result.to_dict(),
                "env": self.env,
            }
            append_jsonl(self.run_dir / ORACLE, json.dumps(line))
        bar.update(8 * scenario.new_tokens if options.oracle is not None else 0)
        if options.vcurve and context not in measured:
            measured.add(context)
            bar.set_description(f"{scenario.name} N={context} v(k)")
            widths = list(range(1, options.base_config.max_draft_length + 2))
            ids = prompt.input_ids
            cache = filled_cache(self.engine, ids, len(widths) + 1)
            repeats = options.vcurve_repeats
            # The engine with and without its few-row linear kernel (v(k) after / before).
            plain_engine = SublayerEngine(self.model, kernels="f.linear")
            for backend, seconds in (
                (
                    "engine",
                    engine_verify_seconds(self.engine, cache, ids.numel(), widths, repeats=repeats),
                ),
                (
                    "engine-f.linear",
                    engine_verify_seconds(
                        plain_engine, cache, ids.numel(), widths, repeats=repeats
                    ),
                ),
                ("hf-dynamic-cache", hf_verify_seconds(self.model, ids, widths, repeats=repeats)),
            ):
                line = {
                    **base,
                    "context_length": int(ids.numel()),
                    "backend": backend,
                    "k": widths,
                    "seconds": seconds,
                    "ratio": [s / seconds[0] for s in seconds],
                    "env": self.env,
                }
                append_jsonl(self.run_dir / VCURVE, json.dumps(line))
            bar.update(2 * scenario.new_tokens)


def run_benchmark(model: Any, tokenizer: Any, options: BenchOptions) -> Path:
    """Run the harness on a loaded ``model`` / ``tokenizer``; returns the run directory.

    Raises:
        LosslessnessError: a greedy method's output differs from plain decoding's.
        FileExistsError: the run directory holds results and ``overwrite`` is off.
    """
    return Harness(model, tokenizer, options).run()


def command_line(argv: Sequence[str] | None) -> str:
    """The command that started this run, for the record."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["knapspec", "bench", *args])


__all__ = ["BenchOptions", "Harness", "command_line", "lookup_drafter_factory", "run_benchmark"]
