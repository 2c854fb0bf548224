"""Running Spec-Bench: every method on every question, interleaved, resumable.

Protocol (Spec-Bench's, plus ``shared/bench-protocol.md``'s interleaving):

* greedy, batch 1, the model's chat template, up to ``max_new_tokens`` per turn; every
  turn of a question is asked in one conversation, after the method's *own* previous
  answers (MT-bench's second turn follows the first answer, as Spec-Bench's ``eval.py``);
* one process, threads fixed; every decoder built, and every method warmed up once on a
  prompt outside the question set, before anything is timed;
* interleaved: for each question and turn, every method runs back to back, the order
  reversed every other question, so that a slow minute of a shared machine falls on all
  methods alike;
* losslessness: every one of our decoders must answer exactly as plain decoding (``ar``)
  did, token for token, or :class:`~knapspec.bench.records.LosslessnessError` stops the
  run (a bug, never a result). ``model.generate`` and transformers' prompt lookup are
  compared in the report only: their kernels differ from our engine's, so in bfloat16 they
  may legitimately pick another token at a near tie;
* resumable: a method's answer is appended (and flushed) when the question's turns are
  done; a rerun skips the question ids a method's file already holds, so Ctrl-C loses at
  most the question in flight. A completed run rewrites each file in question order.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm.auto import tqdm

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.methods import REFERENCE, MethodSpec, SupportsGenerate, method_config
from knapspec.bench.records import LosslessnessError
from knapspec.bench.specbench.answers import (
    Answer,
    Turn,
    append_answer,
    compare_answers,
    drop_partial_line,
    read_answers,
    reorg_answer_file,
)
from knapspec.bench.specbench.calls import (
    CallResult,
    conversation_call,
    engine_call,
    generate_call,
)
from knapspec.bench.specbench.questions import Question
from knapspec.config import DecoderConfig
from knapspec.decoding.conversation import Conversation
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.model.machine import host_cpu_flags

RUN_INFO = "run.json"
ANSWERS = "model_answer"
BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
#: The warm-up prompt: outside every Spec-Bench category.
WARMUP = "List three colours of the rainbow, one per line."


def answer_path(output_dir: Path, method: str) -> Path:
    """Where ``method``'s answer file lives in a run directory."""
    return output_dir / ANSWERS / f"{method}.jsonl"


def _tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, a job scheduler, ``kill``) ends a run as Ctrl-C does: the
    answers written stay and ``run.json`` says ``interrupted``. Main thread only (signal
    handlers can be set there alone); the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@attrs.frozen
class SpecBenchOptions:
    """What to run and where.

    Attributes:
        questions: the questions, in the order they run.
        methods: the methods (``ar``, plain decoding through our engine, must be one).
        output_dir: the run directory (answer files in ``model_answer/``, ``run.json``).
        max_new_tokens: per turn.
        threads: ``torch.set_num_threads`` for the run.
        base_config: the decoder config every engine method's overrides are merged into.
        warmup_tokens: new tokens of each method's warm-up call.
        progress: show a progress bar.
        command, question_file: recorded in ``run.json``.
        question_order: the ids of the whole question file, in order (answer files are
            sorted by it when the run completes).
        stop_on_mismatch: raise when one of our decoders answers differently from plain
            decoding (the default); off, the answer is written and the report marks it
            (for bfloat16, where a batched verify step may round a near tie otherwise).
        reuse_turns: our decoders answer a multi-turn question in one
            :class:`~knapspec.decoding.conversation.Conversation` each, so turn 2
            prefills only its new tokens; single-turn questions are unaffected.
    """

    questions: tuple[Question, ...] = attrs.field(converter=_tuple)
    methods: tuple[MethodSpec, ...] = attrs.field(converter=_tuple)
    output_dir: Path
    max_new_tokens: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    threads: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    base_config: DecoderConfig = attrs.field(factory=DecoderConfig)
    warmup_tokens: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    progress: bool = True
    command: str = ""
    question_file: str = ""
    question_order: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    stop_on_mismatch: bool = True
    reuse_turns: bool = False

    def __attrs_post_init__(self) -> None:
        names = [method.name for method in self.methods]
        if REFERENCE not in names:
            raise ValueError(f"the methods must include plain decoding {REFERENCE!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"method names must be unique, got {names}")


def _eos_ids(model: Any) -> list[int] | None:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return None
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> torch.Tensor:
    """The conversation's prompt ids, the assistant's turn opened (plain text without a
    chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    return torch.tensor(list(ids), dtype=torch.long)


class SpecBenchRun:
    """Runs :class:`SpecBenchOptions` on one loaded model (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, options: SpecBenchOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.engine = SublayerEngine(model)
        self.eos = _eos_ids(model)
        self.env = {
            **environment(model, options.threads),
            **kernel_record(self.engine),
            # What decides whether bfloat16 is fast here (none of these: emulated, slow).
            "bf16_flags": [flag for flag in host_cpu_flags() if flag in BF16_FLAGS],
        }
        self.decoders: dict[str, SupportsGenerate] = {}
        self.commands: list[str] = []

    @property
    def model_name(self) -> str:
        return str(self.env["model"])

    def model_id(self, method: str) -> str:
        """Spec-Bench's ``model_id``: model, method, dtype and temperature."""
        return f"{self.model_name}-{method}-{self.env['dtype']}-temp-0.0"

    # ------------------------------------------------------------------ files
    def _settings(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "dtype": self.env["dtype"],
            "max_new_tokens": self.options.max_new_tokens,
            "reuse_turns": self.options.reuse_turns,
            # Timings from another CPU or thread count would mix into one run's figures.
            "device": self.env["device"],
            "cpu_flags_digest": self.env.get("cpu_flags_digest"),
            "threads": self.options.threads,
        }

    def _check_resumable(self) -> None:
        """A rerun may only add to answers made with the same model, dtype, length, CPU
        and threads (settings an older run did not record are not compared)."""
        path = self.options.output_dir / RUN_INFO
        if not path.exists():
            return
        before = json.loads(path.read_text(encoding="utf-8")).get("settings", {})
        now = self._settings()
        changed = [key for key in now if key in before and before[key] != now[key]]
        if changed:
            raise ValueError(
                f"{self.options.output_dir} holds answers made with "
                + ", ".join(f"{key} = {before[key]}" for key in changed)
                + " (this run: "
                + ", ".join(f"{now[key]}" for key in changed)
                + "); pick another --output-dir"
            )

    def _write_info(self, status: str, **extra: Any) -> None:
        options = self.options
        path = options.output_dir / RUN_INFO
        if not self.commands:  # a resumed run lists every command that added answers
            before = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            self.commands = [c for c in before.get("commands", []) if c != options.command]
            self.commands.append(options.command)
        info = {
            "status": status,
            "command": options.command,
            "commands": self.commands,
            "question_file": options.question_file,
            "settings": self._settings(),
            "threads": options.threads,
            "warmup_tokens": options.warmup_tokens,
            "questions": len(options.questions),
            "methods": [
                {
                    "name": m.name,
                    "kind": m.kind,
                    "description": m.description,
                    "model_id": self.model_id(m.name),
                    "answer_file": str(answer_path(Path(), m.name)),
                    "generate_kwargs": dict(m.generate_kwargs) or None,
                    "config": (
                        method_config(options.base_config, m.config).to_dict()
                        if m.kind == "engine"
                        else None
                    ),
                }
                for m in options.methods
            ],
            "environment": self.env,
            **extra,
        }
        path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------ calls
    def _call(
        self,
        method: MethodSpec,
        ids: torch.Tensor,
        new_tokens: int,
        conversation: Conversation | None = None,
    ) -> CallResult:
        if method.kind == "generate":
            return generate_call(self.model, ids, new_tokens, method.generate_kwargs)
        if conversation is not None:
            return conversation_call(conversation, ids, new_tokens, self.eos)
        return engine_call(self.decoders[method.name], ids, new_tokens, self.eos)

    def _turn(self, result: CallResult, prompt_tokens: int) -> Turn:
        text = self.tokenizer.decode(list(result.output_ids), skip_special_tokens=True).strip()
        return Turn(
            text=text,
            new_tokens=result.new_tokens,
            wall_time=result.wall_time,
            decoding_steps=result.decoding_steps,
            accept_lengths=result.accept_lengths,
            prefill_time=result.prefill_time,
            prompt_tokens=prompt_tokens,
            output_ids=result.output_ids,
        )

    # ------------------------------------------------------------------ the run
    def run(self) -> Path:
        """Run every question a method has not answered yet; returns the run directory.

        Raises:
            LosslessnessError: one of our decoders answered differently from ``ar``.
            ValueError: the run directory holds answers of another model, dtype or length.
        """
        options = self.options
        torch.set_num_threads(options.threads)
        options.output_dir.mkdir(parents=True, exist_ok=True)
        self._check_resumable()
        done: dict[str, set[str]] = {}
        for method in options.methods:
            path = answer_path(options.output_dir, method.name)
            drop_partial_line(path)
            done[method.name] = {answer.key for answer in read_answers(path)}
        reference = {a.key: a for a in read_answers(answer_path(options.output_dir, REFERENCE))}
        todo = [
            (question, [m for m in options.methods if question.key not in done[m.name]])
            for question in options.questions
        ]
        todo = [(question, methods) for question, methods in todo if methods]
        self._write_info("running")
        calls = sum(len(q.turns) * len(methods) for q, methods in todo)
        bar = tqdm(total=calls, unit="call", disable=not options.progress, dynamic_ncols=True)
        signals = contextlib.ExitStack()
        signals.enter_context(_terminate_as_interrupt())
        try:
            if todo:
                self._set_up(bar)
            for index, (question, methods) in enumerate(todo):
                order = methods if index % 2 == 0 else methods[::-1]
                answers = self._question(question, order, bar)
                if options.stop_on_mismatch:
                    self._check(question, answers, reference)
                for answer in answers.values():
                    append_answer(answer_path(options.output_dir, answer.method), answer)
                if REFERENCE in answers:
                    reference[question.key] = answers[REFERENCE]
        except LosslessnessError as error:
            self._write_info("failed", error=str(error))
            raise
        except BaseException as error:  # Ctrl-C and SIGTERM included: the answers written stay
            self._write_info("interrupted", error=f"{type(error).__name__}: {error}")
            raise
        finally:
            bar.close()
            signals.close()
        ids = options.question_order or tuple(q.key for q in options.questions)
        for method in options.methods:
            path = answer_path(options.output_dir, method.name)
            if path.exists():
                reorg_answer_file(path, ids)
        self._write_info("completed")
        return options.output_dir

    def _set_up(self, bar: Any) -> None:
        """Build every decoder, then warm every method up (never timed)."""
        bar.set_description("set-up")
        for method in self.options.methods:
            if method.kind == "engine" and method.name not in self.decoders:
                config = method_config(self.options.base_config, method.config)
                self.decoders[method.name] = method.factory(self.engine, config)
        warm = chat_ids(self.tokenizer, [{"role": "user", "content": WARMUP}])
        for method in self.options.methods:
            self._call(method, warm, self.options.warmup_tokens)

    def _question(
        self, question: Question, order: Sequence[MethodSpec], bar: Any
    ) -> dict[str, Answer]:
        """Every turn of ``question`` for every method in ``order``, interleaved by turn."""
        conversations: dict[str, list[dict[str, str]]] = {m.name: [] for m in order}
        turns: dict[str, list[Turn]] = {m.name: [] for m in order}
        kept = self._kept_caches(question, order)
        try:
            for number, text in enumerate(question.turns):
                for method in order:
                    bar.set_description(
                        f"{question.category} {question.key} turn {number + 1} {method.name}"
                    )
                    messages = conversations[method.name]
                    messages.append({"role": "user", "content": text})
                    ids = chat_ids(self.tokenizer, messages)
                    call = self._call(
                        method, ids, self.options.max_new_tokens, kept.get(method.name)
                    )
                    turn = self._turn(call, len(ids))
                    messages.append({"role": "assistant", "content": turn.text})
                    turns[method.name].append(turn)
                    bar.update(1)
        finally:
            if kept:
                # Single-turn questions keep the default fused prefill: a conversation made
                # the shared engine's prefills chunk-invariant (slower on long prompts).
                self.engine.chunk_invariant = False
        return {
            method.name: Answer(
                question_id=question.question_id,
                category=question.category,
                model_id=self.model_id(method.name),
                method=method.name,
                turns=turns[method.name],
            )
            for method in order
        }

    def _kept_caches(
        self, question: Question, order: Sequence[MethodSpec]
    ) -> dict[str, Conversation]:
        """With ``reuse_turns``, one conversation per engine method for a multi-turn
        question (each turn then prefills only what is new); otherwise none."""
        if not self.options.reuse_turns or len(question.turns) < 2:
            return {}
        return {
            method.name: Conversation(decoder)
            for method in order
            if isinstance(decoder := self.decoders.get(method.name), SpeculativeDecoder)
        }

    def _check(
        self, question: Question, answers: dict[str, Answer], reference: dict[str, Answer]
    ) -> None:
        """Our decoders must answer as plain decoding did (``ar`` of this question, from
        this run or the file a previous run left)."""
        plain = answers.get(REFERENCE) or reference.get(question.key)
        if plain is None:
            return
        kinds = {m.name: m.kind for m in self.options.methods}
        for name, answer in answers.items():
            if kinds[name] != "engine" or name == REFERENCE:
                continue
            equality = compare_answers([answer], [plain], name, REFERENCE)
            if not equality.all_equal:
                difference = equality.differences[0]
                raise LosslessnessError(
                    f"LOSSLESSNESS FAILURE: {name!r} on question {question.key} "
                    f"({question.category}), turn {difference.turn + 1}, differs from plain "
                    f"decoding at {difference.detail}; a greedy method must reproduce it exactly"
                )


def run_spec_bench(model: Any, tokenizer: Any, options: SpecBenchOptions) -> Path:
    """Run Spec-Bench on a loaded ``model``; returns the run directory (see
    :meth:`SpecBenchRun.run`)."""
    return SpecBenchRun(model, tokenizer, options).run()


__all__ = [
    "ANSWERS",
    "RUN_INFO",
    "SpecBenchOptions",
    "SpecBenchRun",
    "answer_path",
    "chat_ids",
    "run_spec_bench",
]
