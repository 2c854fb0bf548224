"""The sublayer engine: a Hugging Face causal LM seen as ``2L`` independently runnable items.

The engine reuses the model's own modules (norms, projections, MLPs, rotary embedding,
LM head) and owns only the attention arithmetic and the KV cache, so that it can

* run any :class:`~knapspec.types.SublayerMask` over new tokens, writing K/V only for the
  attention items that run;
* keep a preallocated, position-indexed cache (cropping is a pointer move);
* run the few-row products of decoding and verification through the kernels this
  machine runs fastest (a :class:`~knapspec.model.kernels.table.KernelTable`, measured once per
  machine by :mod:`knapspec.model.tuning.autotune`), fusing each layer's query/key/value and
  gate/up projections into one product where that pays (:mod:`knapspec.model.kernels.fusion`);
* attend with grouped-query heads packed onto their K/V head, never materialising the
  repeated K/V that ``repeat_kv`` builds for multi-token queries;
* run one item functionally over many DP branches against a read-only cache prefix.

Supported: decoder layers of the Llama layout (input norm, self-attention, post-attention
norm, MLP) with full causal attention — Llama, Mistral, Qwen2, Qwen3 — and Gemma 3's
(``gemma3_text``): a norm before and after each sublayer (the one after applied to the
sublayer's output before the residual add), q/k norms, a GELU-tanh MLP, rotary tables per
layer type, and sliding-window layers beside global ones
(:mod:`knapspec.model.passes.sliding_window`). Gemma's norms (``1 + weight``, q/k norms included)
run compiled as the Llama layout's do (:mod:`knapspec.model.kernels.layer_ops`), its MLP as the
model's own module; the lean pass (:mod:`knapspec.model.passes.exact_pass`) and the
compiled layer loop (:mod:`knapspec.model.kernels.layer_loop`) serve its layers, windows
included.

Size: over 450 lines because full forwards, tree verification, single items and batched
DP items share one attention and MLP implementation and the cache layout; the kernels,
the cache, token trees and weight fusion already live in their own modules.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from knapspec.model.cache import KVCache
from knapspec.model.kernels.fusion import FusedProjection, fuse_linears
from knapspec.model.kernels.layer_ops import (
    RotaryFn,
    apply_norm,
    rotary_,
    serves_norms,
    serves_rotary,
)
from knapspec.model.kernels.onednn import prepack
from knapspec.model.kernels.row_attention import (
    EXACT_MAX_QUERIES,
    attend_tree_rows,
    attention_path,
    kernel_available,
)
from knapspec.model.kernels.table import (
    KERNELS,
    ONEDNN_KERNEL,
    PLAIN_KERNEL,
    Kernel,
    KernelTable,
)
from knapspec.model.passes.exact_pass import EnginePaths, ExactLayerPass
from knapspec.model.passes.sliding_window import attend_rows_windowed, layer_windows, window_visible
from knapspec.model.passes.tree import TreeLayout, tree_layout
from knapspec.model.tuning.autotune import KERNELS_ENV, framework_only, resolve_kernel_table
from knapspec.model.tuning.invariance import InvarianceReport, row_invariant_table
from knapspec.model.tuning.prefill import prefill_dispatch
from knapspec.model.tuning.timing import linear_roles
from knapspec.types import SublayerMask

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")

#: Families whose layers have a norm before and after each sublayer (Gemma 3), and whose
#: sliding-window layers the engine attends exactly.
SANDWICH_MODEL_TYPES: tuple[str, ...] = ("gemma3_text",)

_PLAIN: Kernel = KERNELS[PLAIN_KERNEL]

#: Kernels of the products over more than a table's ``max_rows`` rows, by weight shape.
ManyRowKernels = Mapping[tuple[int, ...], Kernel]


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be run item by item by this engine."""


class OffloadedModelError(UnsupportedModelError):
    """Some of the model's weights are offloaded (accelerate ``device_map`` with ``"cpu"`` or
    ``"disk"`` entries) or spread over several devices."""


class ContextLengthError(ValueError):
    """A sequence would exceed the model's usable context length."""


@attrs.frozen
class ForwardOutput:
    """Result of :meth:`SublayerEngine.forward`.

    Attributes:
        logits: ``(q, vocab)`` for every new token, or ``(1, vocab)`` for the last one only.
        hidden: ``(q, d_model)`` final residual stream (before the final norm).
        points: ``(2L + 1, q, d_model)`` residual stream at every item point, when captured.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    points: torch.Tensor | None = None


def _kept(hidden: torch.Tensor, keep: slice, copy: bool) -> torch.Tensor:
    """What to hold of ``hidden (1, q, d)`` at one item point: its kept rows, copied when
    they are a small part of a long input (so that the full states can be freed);
    otherwise the tensor itself, sliced once for all points after stacking (61 slicing
    ops per verify step cost 0.3 % of a step)."""
    return hidden[0, keep].clone() if copy else hidden


def _check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"knapspec cannot run {type(model).__name__} (model_type={model_type!r}) item by "
            f"item; supported families: {supported} (decoder layers of the Llama layout)."
        )
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no model.layers / lm_head; "
            f"supported families: {supported}."
        )
    needed = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    if model_type in SANDWICH_MODEL_TYPES:
        needed += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        _check_gemma(model, config, supported)
    for index, layer in enumerate(layers):
        for name in needed:
            if not hasattr(layer, name):
                raise UnsupportedModelError(
                    f"layer {index} of {type(model).__name__} has no {name}; the engine needs "
                    f"the Llama layout (supported families: {supported})."
                )
    layer_types = getattr(config, "layer_types", None)
    allowed = {"full_attention"} | (
        {"sliding_attention"} if model_type in SANDWICH_MODEL_TYPES else set()
    )
    if layer_types is not None and any(t not in allowed for t in layer_types):
        raise UnsupportedModelError(
            f"{type(model).__name__} has sliding-window or other non-full attention layers "
            f"({sorted(set(layer_types))}); only full causal attention is supported "
            f"(families: {supported})."
        )


def _check_gemma(model: nn.Module, config: Any, supported: str) -> None:
    """Refuse the Gemma 3 variants the engine does not compute: attention logit
    soft-capping, bidirectional attention."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} soft-caps its attention logits "
            f"(attn_logit_softcapping={config.attn_logit_softcapping}); the engine's attention "
            f"does not (supported families: {supported})."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} attends bidirectionally; the engine is causal "
            f"(supported families: {supported})."
        )


def _module_groups(names: list[str]) -> str:
    """Parameter names -> the distinct modules holding them, e.g. ``model.layers.2, lm_head``."""
    modules: list[str] = []
    for name in names:
        parts = name.split(".")
        layer = parts[:2] == ["model", "layers"] and len(parts) > 3
        prefix = ".".join(parts[:3] if layer else parts[:-1]) or name
        if prefix not in modules:
            modules.append(prefix)
    return ", ".join(modules)


def _check_placement(model: nn.Module) -> None:
    """Refuse weights the engine cannot reach: offloaded by accelerate (kept on the ``meta``
    device and brought in by hooks around each module's ``forward``, which the engine, running
    the layers' parts itself, would bypass) or spread over several devices."""
    offloaded = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if offloaded:
        raise OffloadedModelError(
            f"the engine cannot run a model with offloaded weights ({_module_groups(offloaded)} "
            "are offloaded to CPU or disk by accelerate's device_map): it runs each layer's "
            "projections itself, past the hooks that load them. Load the model on one device "
            "(no device_map, or device_map={'': device}), or use model.generate."
        )
    devices: dict[str, list[str]] = {}
    for name, parameter in model.named_parameters():
        devices.setdefault(str(parameter.device), []).append(name)
    if len(devices) > 1:
        placed = "; ".join(
            f"{device}: {_module_groups(names)}" for device, names in devices.items()
        )
        raise OffloadedModelError(
            f"the engine runs a model on one device; this one is split over {len(devices)} "
            f"({placed}). Load it with device_map={{'': device}}."
        )


class SublayerEngine:
    """Runs a causal LM's ``2L`` items in any subset, with its own KV cache.

    Args:
        model: a loaded ``PreTrainedModel`` of a supported family, in eval mode. Device and
            dtype are read from its parameters.
        kernels: which kernel runs each linear product (decode, draft, verify, and per
            shape those over 16 rows: prefill, batched verification): ``"auto"`` measures
            the candidates (``F.linear``, the transposed products, oneDNN's packed product
            where the build has it and its weight copies fit in a quarter of the memory)
            on this machine once and caches the table (:mod:`knapspec.model.tuning.autotune`;
            a measurement with a progress bar the first time, a file read
            afterwards); ``"f.linear"`` runs every projection
            as the model's own module; ``"transposed"`` is engine revision r3's fixed
            choice; or a :class:`~knapspec.model.kernels.table.KernelTable`. None reads
            ``$KNAPSPEC_KERNELS``, else ``"auto"``. A model on a non-CPU device or in a
            dtype other than float32 always runs the framework's own products.
        fuse_projections: allow running each layer's query/key/value and gate/up
            projections as one product where the table says it pays
            (:mod:`knapspec.model.kernels.fusion`: the layers' weights become row blocks of one
            tensor, same values, same memory).
        progress: a progress bar while a table is measured (None: on a terminal only).
        exact: keep the exactness contract (``docs/theory.md``): the logits and K/V that
            a ``k``-token verification computes for each position are bitwise those of a
            one-token step there, in every dtype. Attention over cached keys runs through
            the row-invariant kernel (:mod:`knapspec.model.kernels.row_attention`) and only
            kernels that pass the row-invariance probe run the products
            (:mod:`knapspec.model.tuning.invariance`). False runs the fastest kernels measured,
            which round differently for different row counts (greedy output may then
            leave plain decoding's at a near-tie, often within tens of tokens in bf16).
        invariant_prefill: whether prefills attend through the row-invariant kernel too
            (in blocks of ``EXACT_MAX_QUERIES`` query rows, with ``exact``, on a CPU where
            the kernel is built), so that a token's K/V and logits depend only on the
            tokens up to it, never on how the sequence was split into calls: what a
            conversation's turns and a prompt resumed from a cached prefix need to equal a
            cold prefill bitwise. It costs prefill speed (the kernel reaches about half of
            PyTorch's fused attention on long causal blocks, so the longer the prompt, the
            more it costs; ``results/engine/HISTORY.md``). ``None`` (the default): off until
            a conversation or a prefix cache asks for it (:meth:`enable_chunk_invariance`);
            True: always; False: never (then cached prefixes are not used and a
            conversation's turns may differ from cold calls at a near-tie). See
            :attr:`chunk_invariant`.
        compiled_layer_ops: with ``exact`` on a CPU, run each layer's RMSNorms and
            rotary as one compiled call each (:mod:`knapspec.model.kernels.layer_ops`; rotary
            bitwise the model's, the norm within an ulp, row-invariant both) where they
            build and compute the model's own, and write a batch's K/V through one compiled
            copy per buffer (bitwise); False keeps the model's modules and PyTorch's
            indexed writes (A/B runs). :attr:`compiled_norms`, :attr:`compiled_rotary` and
            :attr:`compiled_writes` say what runs.
        paths: which of the exact engine's interchangeable paths run (lean passes, the
            compiled layer loop; all on by default): a debug and A/B setting that changes
            no result (:class:`~knapspec.model.passes.exact_pass.EnginePaths`; for a block
            of code, :meth:`use_paths`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        kernels: KernelTable | str | None = None,
        fuse_projections: bool = True,
        progress: bool | None = None,
        exact: bool = True,
        invariant_prefill: bool | None = None,
        compiled_layer_ops: bool = True,
        paths: EnginePaths | None = None,
    ) -> None:
        _check_supported(model)
        _check_placement(model)
        self.model = model
        config: Any = model.config
        self.config = config
        backbone: Any = model.model
        self.embed_tokens: nn.Module = backbone.embed_tokens
        self.layers: list[Any] = list(backbone.layers)
        self.final_norm: nn.Module = backbone.norm
        self.rotary_emb: nn.Module = backbone.rotary_emb
        self.lm_head: nn.Module = model.lm_head  # type: ignore[assignment]
        self.num_layers = len(self.layers)
        self.num_items = 2 * self.num_layers
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        self.kv_groups = self.num_heads // self.kv_heads
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        #: The attention's softmax scale (``1 / sqrt(head_dim)`` for these families).
        self.attention_scale: float = attn.scaling
        self._has_qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        #: Whether each sublayer has a norm before and after it (Gemma 3: the one after
        #: normalises the sublayer's output before the residual add).
        self.sandwich_norms: bool = config.model_type in SANDWICH_MODEL_TYPES
        #: Per layer, its sliding window in tokens, or None (full causal attention).
        self.windows: list[int | None] = (
            layer_windows(config) if self.sandwich_norms else [None] * self.num_layers
        )
        # Per layer, its rotary table's index in :meth:`rotary`'s stack (Gemma 3 has one
        # table per layer type); None: one table for all layers.
        self._rope_types: list[str] | None = None
        self._rope_index: list[int] | None = None
        if self.sandwich_norms:
            self._rope_types = sorted(set(config.layer_types))
            self._rope_index = [self._rope_types.index(t) for t in config.layer_types]
        #: Soft cap of the final logits (``cap * tanh(logits / cap)``), or None.
        self.final_logit_softcapping: float | None = getattr(
            config, "final_logit_softcapping", None
        )
        module = sys.modules[type(attn).__module__]
        self._apply_rotary: RotaryFn = module.apply_rotary_pos_emb
        parameter = next(model.parameters())
        self.device: torch.device = parameter.device
        self.dtype: torch.dtype = parameter.dtype
        limit = int(getattr(config, "max_position_embeddings", 1 << 30))
        window = getattr(config, "sliding_window", None)
        if (
            window is not None
            and getattr(config, "use_sliding_window", True)
            and not self.sandwich_norms  # its windows are attended as such
        ):
            # A sliding window wider than the sequence is plain causal attention; beyond it
            # the results would differ, so it bounds the usable context.
            limit = min(limit, int(window))
        self.max_context: int = limit
        self.model_name: str = str(getattr(config, "_name_or_path", "") or type(model).__name__)
        # Fusion re-points the layers' weights (same values, same memory); only where a
        # table may use it: a float32 CPU model with a table that is not plain F.linear,
        # or an exact CPU engine (its row-invariant table fuses where the kernel computes
        # each output alone: ``invariance._fuse_by_construction``).
        may_fuse = (
            fuse_projections
            and (not framework_only(self) or (exact and self.device.type == "cpu"))
            and not (isinstance(kernels, KernelTable) and kernels.is_plain)
            and (kernels if kernels is not None else os.environ.get(KERNELS_ENV)) != "f.linear"
        )
        self._fused_qkv: list[FusedProjection | None] = [
            fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            if may_fuse
            else None
            for layer in self.layers
        ]
        self._fused_gate_up: list[FusedProjection | None] = [
            fuse_linears(
                [getattr(layer.mlp, "gate_proj", None), getattr(layer.mlp, "up_proj", None)]
            )
            if may_fuse
            else None
            for layer in self.layers
        ]
        self._fuse_projections = fuse_projections
        self.exact = exact
        self._invariant_prefill = invariant_prefill
        #: Whether every forward is a function of the tokens alone, however a sequence is
        #: split into calls (what cached prefixes and conversations rely on to be exact).
        self.chunk_invariant: bool = False
        if invariant_prefill:
            self.enable_chunk_invariance()
        # An exact CPU engine runs its layer norms and rotary as one compiled call each
        # (:mod:`knapspec.model.kernels.layer_ops`) on every path, where they compute the model's
        # own (a norm within an ulp, rotary bitwise): ~16 small PyTorch operations a layer
        # fewer. Decided before anything runs a forward (the kernel probe below does).
        #: Whether batch caches write K/V through one compiled copy (bitwise; any engine).
        self.compiled_writes: bool = compiled_layer_ops and self.device.type == "cpu"
        self._paths = paths if paths is not None else EnginePaths()
        compiled = compiled_layer_ops and exact and self.device.type == "cpu"
        norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
        if self.sandwich_norms:
            norm_names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        norms = [getattr(layer, name) for layer in self.layers for name in norm_names]
        #: Whether the layers' RMSNorms run as one compiled call each (every path).
        self.compiled_norms: bool = compiled and serves_norms(norms, self.dtype)
        qk_norms = [
            getattr(layer.self_attn, name)
            for layer in self.layers
            for name in ("q_norm", "k_norm")
            if self._has_qk_norm
        ]
        #: Whether the per-head q/k RMSNorms (Qwen3, Gemma 3) run as one compiled call each
        #: (every path).
        self.compiled_qk_norms: bool = compiled and serves_norms(qk_norms, self.dtype)
        #: Whether rotary runs in place as one compiled call (bitwise the model's).
        self.compiled_rotary: bool = compiled and serves_rotary(
            self._apply_rotary, self.num_heads, self.kv_heads, self.head_dim, self.dtype
        )
        self.invariance: InvarianceReport | None = None
        self.use_kernels(KernelTable.plain())
        measured = resolve_kernel_table(self, kernels, progress=progress)
        #: The kernel table before the row-invariance probe (what the clock alone chose; on
        #: an exact engine its many-row kernels are a cold prefill's other candidate).
        self.measured_kernels: KernelTable = measured
        table = measured
        if exact and self.device.type == "cpu":
            self.invariance = row_invariant_table(self, table)
            table = self.invariance.table
        self.use_kernels(table)
        if self.invariance is not None:
            # A cold prefill (a prompt from position 0 while chunk invariance is off) runs
            # its many-row products through whichever of the measured and the
            # row-invariant kernels is faster here, timed per shape and prompt length
            # (:mod:`knapspec.model.tuning.prefill`): no verification and no one-token
            # step has that shape (they start past the prompt), plain and speculative
            # decoding share the prefill, and with chunk invariance on (prefix cache,
            # conversations) every prefill keeps the row-invariant kernels.
            self._prefill_large: ManyRowKernels = prefill_dispatch(
                self, measured, table, self._time_cold_prefill
            )

    def _time_cold_prefill(self, dispatch: ManyRowKernels, length: int) -> float:
        """Seconds of one cold prefill of ``length`` tokens (a fixed pseudo-random prompt)
        with ``dispatch`` as its many-row kernels (:mod:`knapspec.model.tuning.prefill`);
        the engine's own stay as they are."""
        generator = torch.Generator().manual_seed(length)
        tokens = torch.randint(0, self.vocab_size, (length,), generator=generator)
        cache = self.new_cache(length)
        start = time.perf_counter()
        self._forward(tokens, 0, cache, None, False, False, None, dispatch)
        return time.perf_counter() - start

    @property
    def paths(self) -> EnginePaths:
        """Which of the exact engine's interchangeable paths run (see
        :class:`~knapspec.model.passes.exact_pass.EnginePaths`)."""
        return self._paths

    @contextlib.contextmanager
    def use_paths(
        self, *, lean_passes: bool | None = None, compiled_loop: bool | None = None
    ) -> Iterator[EnginePaths]:
        """Run other paths while the context is open (the fields given; the rest as they
        are), then the engine's own again: for A/B runs, debugging and tests. Bitwise the
        same results either way (:class:`~knapspec.model.passes.exact_pass.EnginePaths`).

        Yields:
            the paths in force inside the block.
        """
        changes = {"lean_passes": lean_passes, "compiled_loop": compiled_loop}
        kept = self._paths
        self._paths = attrs.evolve(kept, **{k: v for k, v in changes.items() if v is not None})
        try:
            yield self._paths
        finally:
            self._paths = kept

    @property
    def has_qk_norm(self) -> bool:
        """Whether the attention normalises queries and keys per head (Qwen3's q/k norm)."""
        return self._has_qk_norm

    @property
    def exact_attention_path(self) -> str | None:
        """What this exact engine's attention runs on here: ``amx-tiles``, ``avx512-bf16``,
        ``vector`` or ``one-query-calls``
        (:func:`~knapspec.model.kernels.row_attention.attention_path`); None for an inexact engine
        or one off the CPU."""
        if not self.exact or self.device.type != "cpu":
            return None
        return attention_path(self.dtype, self.head_dim)

    def _prefill_by_kernel(self) -> bool:
        """Whether a cold prefill attends through the row-invariant kernel (in 64-query
        blocks) rather than PyTorch's fused attention: where the kernel runs on
        ``VDPBF16PS`` (AVX512-BF16 without tiles). There a long causal bf16 prefill attends
        in about half the time of ``scaled_dot_product_attention``; on the vector path the
        kernel is the slower one, and where the CPU has AMX tiles the fused attention is kept
        too (figures: ``results/engine/HISTORY.md``). Plain and speculative decoding share
        the prefill, so this changes no comparison between them."""
        return self.exact_attention_path == "avx512-bf16"

    def enable_chunk_invariance(self) -> bool:
        """Make every later prefill chunk-invariant (:attr:`chunk_invariant`), unless the
        engine was built with ``invariant_prefill=False`` or cannot be (not ``exact``, not
        on a CPU, no compiled row-invariant kernel for its dtype).

        Returns:
            whether prefills are now chunk-invariant.
        """
        if self._invariant_prefill is not False:
            self.chunk_invariant = (
                self.exact and self.device.type == "cpu" and kernel_available(self.dtype)
            )
        return self.chunk_invariant

    # ---------------------------------------------------------------- kernels
    def use_kernels(self, table: KernelTable) -> None:
        """Run few-row products as ``table`` says from now on (the autotuner swaps tables
        to compare them; a user may pass a table of their own)."""
        if not self._fuse_projections:
            table = table.with_fusion_off()
        self.kernels = table
        self._max_rows = table.max_rows if not table.is_plain else 0
        self._set_dispatch(table.dispatch(), table.large_dispatch())
        #: The kernels of a cold prefill's many-row products (``__init__`` says when they
        #: differ from ``_large``; :meth:`forward` hands them down the call).
        self._prefill_large = self._large
        self._fuse_qkv_rows = table.fuse_rows("qkv")
        self._fuse_gate_up_rows = table.fuse_rows("gate_up")
        # A row-invariant table fuses products over max_rows rows as it fuses few-row ones
        # (a fused and an unfused product round differently).
        uniform = self.exact and table.max_rows > 0
        self._fuse_qkv_large = uniform and all(self._fuse_qkv_rows[1:])
        self._fuse_gate_up_large = uniform and all(self._fuse_gate_up_rows[1:])
        self._prepack(table)

    def _set_dispatch(
        self,
        few: Mapping[tuple[int, ...], tuple[Kernel, ...]],
        large: Mapping[tuple[int, ...], Kernel],
    ) -> None:
        """Install the kernels products run with, read-only (a write that bypassed this would
        leave plans made from the old ones, such as the compiled layer loop's pointers, in
        use), and move :attr:`kernel_generation` so that every such plan is made again."""
        self._dispatch: Mapping[tuple[int, ...], tuple[Kernel, ...]] = MappingProxyType(dict(few))
        self._large: Mapping[tuple[int, ...], Kernel] = MappingProxyType(dict(large))
        #: Moves whenever the kernels change: what a plan made from them compares against.
        self.kernel_generation: int = getattr(self, "kernel_generation", 0) + 1

    @contextlib.contextmanager
    def substituted_products(
        self, kernel: Kernel, shapes: Collection[tuple[int, ...]] | None = None
    ) -> Iterator[None]:
        """Run every product the kernel table routes, of the weight ``shapes`` (all when
        None; fused projections included), through ``kernel`` while the context is open, on
        every path the engine has: items, lean passes, the compiled layer loop (as a
        callback), batched and tree passes, few rows and many, prefill too. The table's
        kernels come back on exit.

        A seam for checks of power, which must put a faulty kernel where the engine really
        computes, and for experiments with a kernel of one's own; the exactness probe does
        not vet ``kernel``.
        """
        few, large, prefill = self._dispatch, self._large, self._prefill_large
        every = set(few) | set(large) | set(prefill)
        chosen = every if shapes is None else {tuple(shape) for shape in shapes}
        unknown = chosen - every
        if unknown:
            raise ValueError(
                f"no product of this engine has the weight shape(s) {sorted(unknown)}; "
                f"its shapes are {sorted(every)}"
            )
        self._set_dispatch(
            {s: (tuple([kernel] * len(k)) if s in chosen else k) for s, k in few.items()},
            {s: (kernel if s in chosen else k) for s, k in large.items()},
        )
        self._prefill_large = {s: (kernel if s in chosen else k) for s, k in prefill.items()}
        try:
            yield
        finally:
            self._set_dispatch(few, large)
            self._prefill_large = prefill

    def _prepack(self, table: KernelTable) -> None:
        """Reorder now every weight ``table`` runs through oneDNN (see
        :func:`knapspec.model.kernels.onednn.prepack`)."""

        def packed(name: str) -> bool:  # oneDNN as it is or in blocks ("onednn/32")
            return name.partition("/")[0] == ONEDNN_KERNEL

        uses = {shape for shape, names in table.choices.items() if any(map(packed, names))}
        uses |= {shape for shape, name in table.large.items() if packed(name)}
        if not uses:
            return
        separate, fused = linear_roles(self)
        for role in (*separate, *fused):
            if role.shape in uses:
                for weight, _ in role.tensors:
                    prepack(weight)

    def fusions(self, group: str) -> list[FusedProjection | None]:
        """Per layer, the fused projection of ``group`` (``"qkv"`` or ``"gate_up"``), or
        None where the layers were not fused."""
        if group == "qkv":
            return list(self._fused_qkv)
        if group == "gate_up":
            return list(self._fused_gate_up)
        raise ValueError(f"unknown fusion group {group!r}; expected 'qkv' or 'gate_up'")

    # ------------------------------------------------------------------ cache
    def new_cache(self, capacity: int = 256) -> KVCache:
        """A fresh cache sized for ``capacity`` tokens (it grows on demand)."""
        return KVCache(
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            min(capacity, self.max_context),
            dtype=self.dtype,
            device=self.device,
            max_capacity=self.max_context,
        )

    def check_context(self, length: int) -> None:
        """Raise :class:`ContextLengthError` when ``length`` tokens exceed the model's context."""
        if length > self.max_context:
            raise ContextLengthError(
                f"sequence of {length} tokens exceeds the model's context of "
                f"{self.max_context} tokens; shorten the prompt or lower max_new_tokens"
            )

    # ------------------------------------------------------------- numerics
    def project(
        self, module: nn.Module, x: torch.Tensor, prefill: ManyRowKernels | None = None
    ) -> torch.Tensor:
        """``module(x)`` for a linear layer, through the table's kernel for few rows.

        Anything but a plain ``nn.Linear`` (a quantised or hooked layer) runs as itself.
        ``prefill``: a cold prefill's many-row kernels, handed down by :meth:`forward`
        during one (None: the table's).
        """
        kernel = self.project_kernel(module, x.numel() // x.shape[-1], prefill)
        if kernel is not None:
            assert isinstance(module, nn.Linear)  # project_kernel serves nothing else
            return kernel(x, module.weight, module.bias)
        result: torch.Tensor = module(x)
        return result

    def project_kernel(
        self, module: nn.Module, rows: int, prefill: ManyRowKernels | None = None
    ) -> Kernel | None:
        """The kernel :meth:`project` runs ``module`` with over ``rows`` rows (``prefill``: a
        cold prefill's many-row kernels, or None), or None where the module runs as itself
        (not a plain ``nn.Linear``, or no kernel for its shape)."""
        if type(module) is not nn.Linear:
            return None
        shape = module.weight.shape
        if rows <= self._max_rows:
            kernels = self._dispatch.get(shape)
            return kernels[rows] if kernels is not None else None
        large = prefill if prefill is not None else self._large
        return large.get(shape)

    def normed(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` for one of a layer's RMSNorms ``x (..., d)``: one compiled call
        where this engine runs them (an exact CPU engine, on all of its paths)."""
        if self.compiled_norms:
            return apply_norm(norm, x)
        result: torch.Tensor = norm(x)
        return result

    def _fused(
        self,
        fused: FusedProjection,
        fuse_rows: tuple[bool, ...],
        x: torch.Tensor,
        fuse_large: bool = False,
        prefill: ManyRowKernels | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The parts' outputs for ``x (..., d)``: one product where the table fuses this
        many rows (``fuse_large``: also over ``max_rows``, outside a cold prefill) and the
        fusion is current; else one product per part (a prefill, see
        :mod:`knapspec.model.kernels.fusion`, or weights replaced since the engine was
        built). ``prefill``: as :meth:`project` takes it."""
        product = self._fused_product(fused, fuse_rows, x, fuse_large, prefill)
        if product is not None:
            return fused.split(product)
        return tuple(self.project(part, x, prefill) for part in fused.parts)

    def _fused_product(
        self,
        fused: FusedProjection,
        fuse_rows: tuple[bool, ...],
        x: torch.Tensor,
        fuse_large: bool,
        prefill: ManyRowKernels | None = None,
    ) -> torch.Tensor | None:
        """:meth:`_fused`'s one product ``(..., Σ sizes)``, or None where it runs the parts."""
        rows = x.numel() // x.shape[-1]
        kernel = self._fused_kernel(fused, fuse_rows, rows, fuse_large, prefill)
        return None if kernel is None else kernel(x, fused.weight, fused.bias)

    def _fused_kernel(
        self,
        fused: FusedProjection,
        fuse_rows: tuple[bool, ...],
        rows: int,
        fuse_large: bool,
        prefill: ManyRowKernels | None = None,
    ) -> Kernel | None:
        """The kernel of ``fused``'s one product over ``rows`` rows, or None where the parts
        run one by one (this many rows not fused, a cold prefill's many rows, or the fusion
        no longer current)."""
        small = rows <= self._max_rows
        fuse_large = fuse_large and prefill is None
        if not ((fuse_rows[rows] if small else fuse_large) and fused.is_current()):
            return None
        shape = fused.weight.shape
        if small:
            kernels = self._dispatch.get(shape)
            return kernels[rows] if kernels is not None else _PLAIN
        return self._large.get(shape, _PLAIN)

    def fused_product(
        self, group: str, layer_index: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """Layer ``layer_index``'s ``group`` (``"qkv"`` or ``"gate_up"``) as the layer
        methods compute it for ``x (..., d)`` where they run it as one product: that
        output ``(..., Σ sizes)`` and the parts' sizes; None where they run the parts
        one by one (no fusion, this many rows not fused, weights replaced)."""
        fusion = self.fusion(group, layer_index, x.numel() // x.shape[-1])
        if fusion is None:
            return None
        fused, kernel = fusion
        return kernel(x, fused.weight, fused.bias), fused.sizes

    def fusion(
        self, group: str, layer_index: int, rows: int
    ) -> tuple[FusedProjection, Kernel] | None:
        """Layer ``layer_index``'s ``group`` (``"qkv"`` or ``"gate_up"``) fusion and the
        kernel of its one product over ``rows`` rows, where the layer methods run it as
        one product (:meth:`fused_product`); else None."""
        if group == "qkv":
            fused, fuse_rows, large = (
                self._fused_qkv[layer_index],
                self._fuse_qkv_rows,
                self._fuse_qkv_large,
            )
        elif group == "gate_up":
            fused, fuse_rows, large = (
                self._fused_gate_up[layer_index],
                self._fuse_gate_up_rows,
                self._fuse_gate_up_large,
            )
            if not self._max_rows and not self._large:
                return None  # :meth:`_gated_mlp` runs the module itself
        else:
            raise ValueError(f"unknown fusion group {group!r}; expected 'qkv' or 'gate_up'")
        if fused is None:
            return None
        kernel = self._fused_kernel(fused, fuse_rows, rows, large)
        return None if kernel is None else (fused, kernel)

    def _gated_mlp(
        self, layer_index: int, x: torch.Tensor, prefill: ManyRowKernels | None = None
    ) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))``, the Llama/Mistral/Qwen MLP, via :meth:`project`
        (``prefill`` as it takes it)."""
        mlp = self.layers[layer_index].mlp
        gate = getattr(mlp, "gate_proj", None)
        up = getattr(mlp, "up_proj", None)
        down = getattr(mlp, "down_proj", None)
        act = getattr(mlp, "act_fn", None)
        if (
            (not self._max_rows and not self._large)
            or gate is None
            or up is None
            or down is None
            or act is None
        ):
            result: torch.Tensor = mlp(x)
            return result
        fused = self._fused_gate_up[layer_index]
        if fused is not None:
            gated, upward = self._fused(
                fused, self._fuse_gate_up_rows, x, self._fuse_gate_up_large, prefill
            )
        else:
            gated, upward = self.project(gate, x, prefill), self.project(up, x, prefill)
        hidden = act(gated)
        hidden.mul_(upward)  # in place: one (rows, d_ff) allocation fewer
        return self.project(down, hidden, prefill)

    def rotary(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary cos/sin for ``positions (q,)``: each ``(1, q, head_dim)``,
        in the dtype of ``like``; for a model with a table per layer type (Gemma 3) each
        ``(types, q, head_dim)``, which :meth:`project_qkv` picks from per layer.
        :meth:`step_item` takes them precomputed."""
        return self.rotary_tables(like, positions.unsqueeze(0))

    def rotary_tables(
        self, like: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos/sin of ``positions (b, q)`` as the model's rotary module gives
        them, ``(b, q, hd)`` each; stacked over the layer types, ``(types * b, q, hd)``, for
        a model with one table per type (:meth:`layer_rotary` picks a layer's)."""
        if self._rope_types is None:
            cos, sin = self.rotary_emb(like, positions)
            return cos, sin
        tables = [self.rotary_emb(like, positions, kind) for kind in self._rope_types]
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def layer_rotary(
        self, layer_index: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_index``'s rotary tables out of :meth:`rotary_tables`' (the same
        tensors where all layers share one)."""
        if self._rope_index is None:
            return cos, sin
        assert self._rope_types is not None  # set with _rope_index
        rows = cos.shape[0] // len(self._rope_types)
        first = self._rope_index[layer_index] * rows
        return cos[first : first + rows], sin[first : first + rows]

    def project_qkv(
        self,
        layer_index: int,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefill: ManyRowKernels | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(b, H, q, hd)`` and keys/values ``(b, kvH, q, hd)`` with rotary applied
        (``prefill``: as :meth:`project` takes it)."""
        attn = self.layers[layer_index].self_attn
        cos, sin = self.layer_rotary(layer_index, cos, sin)
        batch, q_len, _ = normed.shape
        shape = (batch, q_len, -1, self.head_dim)
        fused = self._fused_qkv[layer_index]
        if fused is not None:
            query, key, value = (
                part.reshape(shape)
                for part in self._fused(
                    fused, self._fuse_qkv_rows, normed, self._fuse_qkv_large, prefill
                )
            )
        else:
            query = self.project(attn.q_proj, normed, prefill).view(shape)
            key = self.project(attn.k_proj, normed, prefill).view(shape)
            value = self.project(attn.v_proj, normed, prefill).view(shape)
        if self.compiled_qk_norms:
            query, key = apply_norm(attn.q_norm, query), apply_norm(attn.k_norm, key)
        elif self._has_qk_norm:
            query = attn.q_norm(query)
            key = attn.k_norm(key)
        if self.compiled_rotary and rotary_(query, key, cos, sin):
            # Rotated in place (bitwise the model's rotary) before the transposes.
            return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        query = query.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        query, key = self._apply_rotary(query, key, cos, sin)
        return query, key, value

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Grouped-query attention without repeating K/V.

        Args:
            query: ``(b, H, q, hd)``; keys, values: ``(b, kvH, k, hd)``.
            mask: ``(q, k)`` bool (True = may attend) or None for "attend to all keys".
            is_causal: square causal attention (prefill from position 0).

        Returns:
            ``(b, q, H * hd)``.
        """
        batch, heads, q_len, head_dim = query.shape
        if is_causal:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.attention_scale, enable_gqa=True
            )
        else:
            groups = self.kv_groups
            # Query heads g*groups .. g*groups+groups-1 share K/V head g: fold them into the
            # query axis so that one SDPA call per K/V head serves the whole group.
            packed = query.reshape(batch, self.kv_heads, groups * q_len, head_dim)
            packed_mask = None if mask is None else mask.repeat(groups, 1)
            out = F.scaled_dot_product_attention(
                packed, keys, values, attn_mask=packed_mask, scale=self.attention_scale
            )
            out = out.reshape(batch, heads, q_len, head_dim)
        return out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)

    def attend_exact(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``q`` new tokens at positions ``start ..`` through the
        row-invariant kernel: ``query (H, q, hd)``, ``keys/values (kvH, start + q, hd)``
        -> ``(1, q, H * hd)``; token ``t`` sees keys ``0 .. start + t`` (the last
        ``window`` of them in a sliding layer), and its output is bitwise what a one-token
        step at ``start + t`` computes."""
        q_len = query.shape[1]
        lengths = torch.arange(start + 1, start + q_len + 1)
        out = attend_rows_windowed(
            query, keys, values, lengths, window, self.attention_scale
        )  # (H, q, hd)
        return out.transpose(0, 1).reshape(1, q_len, self.num_heads * self.head_dim)

    def _attend_blocks(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        window: int | None = None,
    ) -> torch.Tensor:
        """:meth:`attend_exact` over blocks of at most ``EXACT_MAX_QUERIES`` query rows, each
        against the keys up to its last row: ``query (H, q, hd)``, ``keys/values
        (kvH, start + q, hd)`` -> ``(1, q, H * hd)``. Rows do not depend on each other, so
        the blocking changes no bit; it bounds the score buffer and skips the keys a
        block's rows cannot see (causal work only)."""
        q_len = query.shape[1]
        if q_len <= EXACT_MAX_QUERIES:
            return self.attend_exact(query, keys, values, start, window)
        blocks = []
        for first in range(0, q_len, EXACT_MAX_QUERIES):
            last = min(q_len, first + EXACT_MAX_QUERIES)
            end = start + last
            blocks.append(
                self.attend_exact(
                    query[:, first:last], keys[:, :end], values[:, :end], start + first, window
                )
            )
        return torch.cat(blocks, dim=1)

    def _attend_tree(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tree: TreeLayout,
        window: int | None = None,
    ) -> torch.Tensor:
        """Tree attention (:meth:`forward_tree`): ``query (1, H, q, hd)``, ``keys/values
        (1, kvH, start + q, hd)`` -> ``(1, q, H * hd)``. Exact engines use the tree mode of
        the row-invariant kernel (or its exact one-row-at-a-time fallback), bitwise a
        one-token step on the compacted path; others one masked SDPA call (correct up to
        rounding)."""
        if window is not None and int(tree.positions.max()) + 1 > window:
            return self._attend_tree_windowed(query, keys, values, tree, window)
        if not self.exact:
            return self._attend(query, keys, values, tree.mask(self.device))
        out = attend_tree_rows(
            query[0], keys[0], values[0], tree.prefix, tree.visible, self.attention_scale
        )
        return out.transpose(0, 1).reshape(1, tree.size, self.num_heads * self.head_dim)

    def _attend_tree_windowed(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tree: TreeLayout,
        window: int,
    ) -> torch.Tensor:
        """:meth:`_attend_tree` in a sliding layer whose window some node's view exceeds:
        node ``i`` (at position ``p``) sees its visible keys at positions ``> p - window``,
        gathered in order and attended as one row, as the one-token step at ``p`` on the
        compacted path attends them (exact engines through the row-invariant kernel: the
        same keys, in the same order, the same count)."""
        start = tree.start
        visible = tree.mask(self.device)  # (q, start + q) bool
        slots = torch.arange(visible.shape[1], device=self.device)
        key_positions = torch.where(
            slots < start, slots, tree.positions.to(self.device)[(slots - start).clamp(min=0)]
        )
        inside = window_visible(tree.positions.to(self.device), key_positions, window)
        assert inside is not None
        visible = visible & inside
        rows = []
        for node in range(tree.size):
            index = visible[node].nonzero().squeeze(1)
            row_keys, row_values = keys[0][:, index], values[0][:, index]
            length = torch.tensor([index.numel()], dtype=torch.int64)
            if self.exact:
                rows.append(
                    attend_rows_windowed(
                        query[0][:, node : node + 1],
                        row_keys,
                        row_values,
                        length,
                        None,
                        self.attention_scale,
                    )
                )
            else:
                rows.append(
                    self._attend(
                        query[:, :, node : node + 1], row_keys[None], row_values[None], None
                    )
                    .reshape(1, self.num_heads, self.head_dim)
                    .transpose(0, 1)
                )
        out = torch.cat(rows, dim=1)  # (H, q, hd)
        return out.transpose(0, 1).reshape(1, tree.size, self.num_heads * self.head_dim)

    def _attention_item(
        self,
        layer_index: int,
        hidden: torch.Tensor,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        tree: TreeLayout | None = None,
        lean: ExactLayerPass | None = None,
        prefill: ManyRowKernels | None = None,
    ) -> torch.Tensor:
        """Run layer ``layer_index``'s attention item on ``hidden (1, q, d)``, writing K/V
        (with ``tree``, node ``i`` at slot ``start + i``, attending as :meth:`forward_tree`
        says); through ``lean`` (:meth:`_lean_pass`) where it serves this layer; ``prefill``
        as :meth:`project` takes it."""
        if lean is not None:
            cache.check_gap(layer_index, start)
            stepped = lean.attention_item(layer_index, hidden)
            if stepped is not None:
                cache.lengths[layer_index] = start + hidden.shape[1]  # as KVCache.write sets
                return stepped
        layer = self.layers[layer_index]
        q_len = hidden.shape[1]
        query, key, value = self.project_qkv(
            layer_index, self.normed(layer.input_layernorm, hidden), cos, sin, prefill
        )
        cache.write(layer_index, start, key[0], value[0])
        end = start + q_len
        keys = cache.keys(layer_index, end).unsqueeze(0)
        values = cache.values(layer_index, end).unsqueeze(0)
        window = self.windows[layer_index]
        if window is not None and end <= window:
            window = None  # no token here sees past the window: plain causal attention
        if tree is not None:
            attended = self._attend_tree(query, keys, values, tree, window)
        elif self.chunk_invariant or (start == 0 and q_len > 1 and self._prefill_by_kernel()):
            attended = self._attend_blocks(query[0], keys[0], values[0], start, window)
        elif self.exact and (start > 0 or q_len == 1) and q_len <= EXACT_MAX_QUERIES:
            attended = self.attend_exact(query[0], keys[0], values[0], start, window)
        elif window is not None:
            positions = torch.arange(start, end, device=self.device)
            inside = window_visible(positions, torch.arange(end, device=self.device), window)
            assert inside is not None
            mask = causal_mask(start, q_len, self.device) & inside
            attended = self._attend(query, keys, values, mask)
        elif start == 0 and q_len > 1:
            attended = self._attend(query, keys, values, None, is_causal=True)
        elif q_len == 1:
            attended = self._attend(query, keys, values, None)
        else:
            attended = self._attend(query, keys, values, causal_mask(start, q_len, self.device))
        return self.attention_residual(layer_index, hidden, attended, prefill)

    def attention_residual(
        self,
        layer_index: int,
        hidden: torch.Tensor,
        attended: torch.Tensor,
        prefill: ManyRowKernels | None = None,
    ) -> torch.Tensor:
        """The residual stream ``hidden (..., d)`` after layer ``layer_index``'s attention
        whose heads' output is ``attended (..., H * hd)``: plus its output projection,
        normalised first where the layers have a norm after each sublayer (Gemma 3);
        ``prefill`` as :meth:`project` takes it."""
        layer = self.layers[layer_index]
        out = self.project(layer.self_attn.o_proj, attended, prefill)
        if self.sandwich_norms:
            out = self.normed(layer.post_attention_layernorm, out)
        output: torch.Tensor = hidden + out
        return output

    def mlp_item(
        self,
        layer_index: int,
        hidden: torch.Tensor,
        lean: ExactLayerPass | None = None,
        prefill: ManyRowKernels | None = None,
    ) -> torch.Tensor:
        """The residual stream ``(b, q, d)`` after layer ``layer_index``'s MLP sublayer
        (through ``lean``, a pass's :class:`~knapspec.model.passes.exact_pass.ExactLayerPass`,
        where it serves this layer: bitwise the same; ``prefill`` as :meth:`project` takes
        it)."""
        if lean is not None:
            stepped = lean.mlp_item(layer_index, hidden)
            if stepped is not None:
                return stepped
        layer = self.layers[layer_index]
        if self.sandwich_norms:
            normed = self.normed(layer.pre_feedforward_layernorm, hidden)
            fed = self._gated_mlp(layer_index, normed, prefill)
            sandwiched: torch.Tensor = hidden + self.normed(layer.post_feedforward_layernorm, fed)
            return sandwiched
        output: torch.Tensor = hidden + self._gated_mlp(
            layer_index, self.normed(layer.post_attention_layernorm, hidden), prefill
        )
        return output

    # ------------------------------------------------------------- public API
    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        cache: KVCache,
        mask: SublayerMask | None = None,
        *,
        all_logits: bool = True,
        capture_points: bool = False,
        capture_last: int | None = None,
    ) -> ForwardOutput:
        """Run the items of ``mask`` (all items when None) over new tokens.

        Args:
            token_ids: ``(q,)`` token ids at positions ``start .. start + q - 1``.
            start: position of the first new token; every executed attention layer must
                hold exactly the positions before it.
            cache: written for executed attention items only.
            all_logits: logits for every new token (verification) or only the last one.
            capture_points: also return the residual stream at all ``2L + 1`` points.
            capture_last: with ``capture_points``, keep only the last this-many tokens.

        Returns:
            :class:`ForwardOutput`.
        """
        return self._forward(
            token_ids,
            start,
            cache,
            mask,
            all_logits,
            capture_points,
            capture_last,
            self._prefill_large,
        )

    @torch.inference_mode()
    def _forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        cache: KVCache,
        mask: SublayerMask | None,
        all_logits: bool,
        capture_points: bool,
        capture_last: int | None,
        prefill_kernels: ManyRowKernels,
    ) -> ForwardOutput:
        """:meth:`forward`, a cold prefill's many-row products through ``prefill_kernels``
        (the engine's own, or those :meth:`_time_cold_prefill` times)."""
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(
                f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}"
            )
        if mask is not None and mask.num_items != self.num_items:
            raise ValueError(
                f"mask has {mask.num_items} items but the model has {self.num_items} "
                f"({self.num_layers} layers x attention + MLP)"
            )
        q_len = token_ids.numel()
        self.check_context(start + q_len)
        token_ids = token_ids.to(self.device)
        hidden = self.embed_tokens(token_ids).unsqueeze(0)
        positions = torch.arange(start, start + q_len, device=self.device)
        cos, sin = self.rotary(positions, hidden)
        keep = slice(None) if capture_last is None else slice(max(0, q_len - capture_last), None)
        # Slices of long inputs are copied so that the full (q, d) states can be freed.
        copy = capture_last is not None and capture_last < q_len
        points: list[torch.Tensor] = [_kept(hidden, keep, copy)] if capture_points else []
        executed = mask.executed if mask is not None else (True,) * self.num_items
        # A cold prefill (a prompt from position 0 while chunk invariance is off) hands its
        # many-row kernels down the call; every other call runs the table's. (At position 0
        # the lean pass and the layer loop serve a single token, never a many-row product.)
        prefill = prefill_kernels if start == 0 and not self.chunk_invariant else None
        lean = self._lean_pass(start, q_len, cos, sin, cache)
        looped = None
        if lean is not None and not capture_points:
            looped = self._run_loop(lean, hidden, start, cache, executed)
        for layer_index in range(self.num_layers if looped is None else 0):
            if executed[2 * layer_index]:
                hidden = self._attention_item(
                    layer_index, hidden, start, cos, sin, cache, lean=lean, prefill=prefill
                )
            if capture_points:
                points.append(_kept(hidden, keep, copy))
            if executed[2 * layer_index + 1]:
                hidden = self.mlp_item(layer_index, hidden, lean, prefill)
            if capture_points:
                points.append(_kept(hidden, keep, copy))
        final = hidden[0] if looped is None else looped[0]
        logits = self.logits(final if all_logits else final[-1:], prefill)
        stacked = None
        if capture_points:
            stacked = torch.stack(points) if copy else torch.stack(points)[:, 0, keep]
        return ForwardOutput(logits=logits, hidden=final, points=stacked)

    def _run_loop(
        self,
        lean: ExactLayerPass,
        hidden: torch.Tensor,
        start: int,
        cache: KVCache,
        executed: Sequence[bool] | None = None,
    ) -> torch.Tensor | None:
        """``lean``'s layer loop in one compiled call (:meth:`ExactLayerPass.run_layers`;
        ``executed``: a mask's flags, None for every item) over a single-sequence ``cache``
        holding ``start`` tokens in every executed attention layer: the last layer's
        residual stream ``(1, q, d)``, those layers' lengths set; None where it does not
        serve."""
        attends = [
            layer for layer in range(self.num_layers) if executed is None or executed[2 * layer]
        ]
        for layer_index in attends:
            cache.check_gap(layer_index, start)
        looped = lean.run_layers(hidden, executed)
        if looped is not None:
            for layer_index in attends:  # as KVCache.write sets them
                cache.lengths[layer_index] = start + hidden.shape[1]
        return looped

    def _lean_pass(
        self,
        start: int,
        q_len: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        tree: TreeLayout | None = None,
    ) -> ExactLayerPass | None:
        """The lean pass (:mod:`knapspec.model.passes.exact_pass`) of a decode step, a verification
        of ``q_len <= EXACT_MAX_QUERIES`` tokens or a token tree at ``start`` (where
        :meth:`_attention_item` attends through the row-invariant kernel); None for a
        prefill, an inexact engine, or where it does not serve."""
        if not self.exact or q_len > EXACT_MAX_QUERIES or (start == 0 and q_len > 1):
            return None
        cache.reserve(start + q_len)
        slots = torch.arange(start, start + q_len)
        index = (torch.zeros(q_len, dtype=torch.int64), slots)
        lengths = (slots + 1).unsqueeze(0) if tree is None else None
        rows = (tree.prefix, tree.visible) if tree is not None else None
        positions = tree.positions if tree is not None else None
        return ExactLayerPass.prepare(
            self, cache, self.compiled_writes, cos, sin, index, lengths, None, rows, positions
        )

    @torch.inference_mode()
    def forward_tree(
        self,
        token_ids: torch.Tensor,
        start: int,
        parents: torch.Tensor | Sequence[int],
        cache: KVCache,
        *,
        capture_points: bool = False,
    ) -> ForwardOutput:
        """Verify a token tree in one pass of the full model.

        Node ``i`` sits at position ``start + depth(i)``; its K/V are written at slot
        ``start + i`` of every layer, and it attends to positions ``0 .. start - 1`` and to
        its ancestors and itself (:mod:`knapspec.model.passes.tree`). On an exact engine each
        node's logits and K/V are bitwise those of one-token steps along its root-to-node
        path (after :meth:`KVCache.compact` of that path, the cache is bitwise theirs too);
        a chain (``parents = [-1, 0, 1, ...]``) gives bitwise :meth:`forward`'s logits.
        An engine built with ``exact=False`` attends through one masked SDPA call
        (correct up to rounding).

        Args:
            token_ids: ``(q,)`` with ``1 <= q <= EXACT_MAX_QUERIES``; node 0 is the pending
                token at position ``start``.
            start: every layer must hold exactly the positions before it.
            parents: ``(q,)``: ``parents[0] == -1`` and ``0 <= parents[i] < i``.
            capture_points: also return the residual stream at all ``2L + 1`` points.

        Returns:
            :class:`ForwardOutput`: logits ``(q, vocab)`` float32, hidden ``(q, d_model)``,
            points ``(2L + 1, q, d_model)`` when captured.

        Raises:
            ValueError: on malformed ``token_ids`` or ``parents`` (see
                :func:`knapspec.model.passes.tree.tree_layout`).
        """
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError(
                f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}"
            )
        q_len = token_ids.numel()
        tree = tree_layout(parents, start, q_len)
        self.check_context(start + q_len)
        hidden = self.embed_tokens(token_ids.to(self.device)).unsqueeze(0)
        cos, sin = self.rotary(tree.positions.to(self.device), hidden)
        points: list[torch.Tensor] = [hidden[0]] if capture_points else []
        lean = self._lean_pass(start, q_len, cos, sin, cache, tree)
        looped = None
        if lean is not None and not capture_points:
            looped = self._run_loop(lean, hidden, start, cache)
        for layer_index in range(self.num_layers if looped is None else 0):
            hidden = self._attention_item(layer_index, hidden, start, cos, sin, cache, tree, lean)
            points += [hidden[0]] if capture_points else []
            hidden = self.mlp_item(layer_index, hidden, lean)
            points += [hidden[0]] if capture_points else []
        final = hidden[0] if looped is None else looped[0]
        stacked = torch.stack(points) if capture_points else None
        return ForwardOutput(logits=self.logits(final), hidden=final, points=stacked)

    def logits(self, hidden: torch.Tensor, prefill: ManyRowKernels | None = None) -> torch.Tensor:
        """Final norm and LM head: ``(..., d_model) -> (..., vocab)`` in float32
        (``prefill`` as :meth:`project` takes it)."""
        logits: torch.Tensor = self.project(self.lm_head, self.final_norm(hidden), prefill)
        cap = self.final_logit_softcapping
        if cap is not None:  # as the model's forward does, in the model's dtype
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def step_item(
        self,
        item: int,
        hidden: torch.Tensor,
        start: int,
        cache: KVCache,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Run one item exactly as :meth:`forward` does inside a step (the decode path).

        An attention item writes its K/V at positions ``start ..`` into ``cache`` and
        attends causally to everything cached before them; an MLP item ignores the cache.
        The latency profiler times items through this method.

        Args:
            item: item index in ``[0, 2L)`` (``2l``: layer ``l``'s attention, ``2l + 1``: MLP).
            hidden: ``(1, q, d_model)`` residual stream entering the item.
            start: position of the first of the ``q`` tokens; the item's layer must cache
                exactly the positions before it.
            rotary: :meth:`rotary` of the ``q`` positions (computed once per step, as in
                :meth:`forward`).

        Returns:
            ``(1, q, d_model)``: the residual stream after the item.
        """
        if not 0 <= item < self.num_items:
            raise ValueError(f"item {item} out of range [0, {self.num_items})")
        layer_index = item // 2
        if item % 2 == 1:
            return self.mlp_item(layer_index, hidden)
        cos, sin = rotary  # KVCache.write refuses a gap before ``start``
        return self._attention_item(layer_index, hidden, start, cos, sin, cache)

    @torch.inference_mode()
    def run_item(
        self,
        item: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        prefix_length: int,
    ) -> torch.Tensor:
        """Run one item on ``B`` independent branches without touching the cache.

        Each branch is a window of ``q`` consecutive tokens at ``positions``. For an
        attention item, every branch attends to the cache's first ``prefix_length``
        positions of that layer (read-only) and to its *own* window keys causally — never
        another branch's (a block-causal mask built with tensor ops).

        Args:
            item: item index in ``[0, 2L)``.
            hidden: ``(B, q, d_model)`` residual stream entering the item.
            positions: ``(q,)`` true positions of the window tokens.
            prefix_length: cached positions the window may see (the context before it).

        Returns:
            ``(B, q, d_model)``: the residual stream after the item.
        """
        if not 0 <= item < self.num_items:
            raise ValueError(f"item {item} out of range [0, {self.num_items})")
        layer_index = item // 2
        if item % 2 == 1:
            return self.mlp_item(layer_index, hidden)
        if prefix_length > cache.lengths[layer_index]:
            raise ValueError(
                f"layer {layer_index} caches {cache.lengths[layer_index]} tokens, fewer than the "
                f"requested prefix of {prefix_length}"
            )
        layer = self.layers[layer_index]
        branches, q_len, _ = hidden.shape
        cos, sin = self.rotary(positions.to(self.device), hidden)
        query, key, value = self.project_qkv(
            layer_index, self.normed(layer.input_layernorm, hidden), cos, sin
        )
        # All branches' queries in one row block: (1, H, B*q, hd); keys: prefix then windows.
        query = query.transpose(0, 1).reshape(1, self.num_heads, branches * q_len, self.head_dim)
        window_keys = key.transpose(0, 1).reshape(self.kv_heads, branches * q_len, self.head_dim)
        window_values = value.transpose(0, 1).reshape(
            self.kv_heads, branches * q_len, self.head_dim
        )
        keys = torch.cat([cache.keys(layer_index, prefix_length), window_keys], dim=1).unsqueeze(0)
        values = torch.cat(
            [cache.values(layer_index, prefix_length), window_values], dim=1
        ).unsqueeze(0)
        mask = block_causal_mask(branches, q_len, prefix_length, self.device)
        window = self.windows[layer_index]
        if window is not None:
            at = positions.to(self.device)
            rows = at.repeat(branches)
            columns = torch.cat([torch.arange(prefix_length, device=self.device), rows])
            inside = window_visible(rows, columns, window)
            assert inside is not None
            mask = mask & inside
        attended = self._attend(query, keys, values, mask)  # (1, B*q, H*hd)
        attended = attended.reshape(branches, q_len, self.num_heads * self.head_dim)
        return self.attention_residual(layer_index, hidden, attended)

    @torch.inference_mode()
    def run_masks(
        self,
        masks: list[SublayerMask],
        start_hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        prefix_length: int,
    ) -> torch.Tensor:
        """Teacher-forced run of several masks over one window, batched as branches.

        Every item is run once on all branches that execute it; branches that skip it keep
        their state. The cache is read, never written.

        Args:
            masks: ``B`` masks.
            start_hidden: ``(r, d)`` residual stream at point 0 (the embeddings).
            positions: ``(r,)`` window positions; prefix_length: context before the window.

        Returns:
            ``(B, r, d)`` final residual states (before the final norm).
        """
        if not masks:
            raise ValueError("run_masks needs at least one mask")
        for mask in masks:
            if mask.num_items != self.num_items:
                raise ValueError(f"mask has {mask.num_items} items, the model {self.num_items}")
        hidden = start_hidden.unsqueeze(0).expand(len(masks), -1, -1).contiguous()
        table = torch.tensor([m.executed for m in masks], device=self.device)  # (B, 2L)
        for item in range(self.num_items):
            runs = table[:, item]
            if not bool(runs.any()):
                continue
            index = runs.nonzero().squeeze(1)
            hidden[index] = self.run_item(item, hidden[index], positions, cache, prefix_length)
        return hidden


def causal_mask(start: int, q_len: int, device: torch.device) -> torch.Tensor:
    """``(q, start + q)`` bool mask: new token ``t`` sees positions ``<= start + t``."""
    rows = torch.arange(start, start + q_len, device=device).unsqueeze(1)
    cols = torch.arange(start + q_len, device=device).unsqueeze(0)
    return cols <= rows


def block_causal_mask(
    branches: int, q_len: int, prefix_length: int, device: torch.device
) -> torch.Tensor:
    """``(B*q, prefix + B*q)`` bool mask for :meth:`SublayerEngine.run_item`.

    Every row sees the whole shared prefix; within the window block, row ``(b, t)`` sees
    column ``(b', t')`` iff ``b == b'`` and ``t' <= t``.
    """
    index = torch.arange(branches * q_len, device=device)
    branch, step = index // q_len, index % q_len
    window = (branch.unsqueeze(1) == branch.unsqueeze(0)) & (step.unsqueeze(0) <= step.unsqueeze(1))
    prefix = torch.ones(branches * q_len, prefix_length, dtype=torch.bool, device=device)
    return torch.cat([prefix, window], dim=1)
