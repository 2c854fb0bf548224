"""Latency profiles: versioned JSON records of sublayer timings on one machine.

A :class:`LatencyProfile` holds the raw medians measured by
:func:`knapspec.costmodels.profiler.profile_engine` and the :class:`ProfileKey` that says
where they are valid: the model (name and a fingerprint of its dimensions and weights), the
dtype, device, thread count, attention implementation, cache type, library versions, host
CPU and the engine's kernel table (:meth:`~knapspec.model.kernels.table.KernelTable.fingerprint`).
A profile measured under another key is refused by :meth:`LatencyProfile.check_compatible`
unless forced, because item latencies do not carry over between machines, thread counts,
kernels or cache implementations (method spec §2).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import transformers

from knapspec.costmodels.local_layers import (
    Windows,
    check_windows,
    engine_windows,
    normalized_windows,
)
from knapspec.model.cachefiles import replace_atomically
from knapspec.model.machine import host_cpu_model

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

SCHEMA_VERSION = 1
"""Version of the JSON layout written by :meth:`LatencyProfile.save`."""

ATTENTION_IMPLEMENTATION = "knapspec-engine-r4"
"""Timings go through the engine's own arithmetic, not ``attn_implementation``. The suffix
is the engine's kernel revision (r2: few-row linear layers, :mod:`knapspec.model.kernels.table`;
r3: fused q/k/v and gate/up products, :mod:`knapspec.model.kernels.fusion`; r4: a full pass's
layer loop in one compiled call, :mod:`knapspec.model.kernels.layer_loop`, which made steps
faster);
bump it whenever the engine's own code changes speed, so that older timings are refused. Which
few-row kernels run is machine-specific and lives in the key's ``kernel_table`` field."""

CACHE_TYPE = "knapspec-preallocated"
"""The engine's preallocated, position-indexed :class:`~knapspec.model.cache.KVCache`."""

#: Key fields that may differ without invalidating the timings: the model's name is a path
#: or hub id (the fingerprint identifies the weights), and knapspec's own version does not
#: change the arithmetic being timed unless the engine changes, which bumps SCHEMA_VERSION.
_INFORMATIONAL_KEY_FIELDS = frozenset({"model_name", "knapspec_version"})


class ProfileError(ValueError):
    """A profile file is missing, empty, corrupt, of another schema, or holds invalid timings."""


class ProfileMismatchError(ProfileError):
    """A valid profile that was measured for another model or machine."""


def _library_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def device_description(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda:<index> <device name>"`` so that two GPU models differ."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return str(device)


def model_fingerprint(engine: SublayerEngine) -> str:
    """Identify a model by its dimensions, parameter count and a hash of a few weights.

    Two checkpoints of the same architecture (e.g. a fine-tune) time the same, but a profile
    tied to the exact weights is the conservative choice: the fingerprint is cheap and
    cannot collide between differently shaped models.
    """
    config = engine.config
    model = engine.model
    parameters = sum(p.numel() for p in model.parameters())
    digest = hashlib.sha256()
    # First values of the embedding, the first layer's query projection and the LM head.
    for module in (engine.embed_tokens, engine.layers[0].self_attn.q_proj, engine.lm_head):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        sample = weight.detach().reshape(-1)[:32].to("cpu", torch.float64)
        digest.update(sample.numpy().round(6).tobytes())
    intermediate = getattr(config, "intermediate_size", 0)
    return (
        f"{config.model_type}-L{engine.num_layers}-d{engine.hidden_size}-h{engine.num_heads}"
        f"-kv{engine.kv_heads}-ff{intermediate}-v{engine.vocab_size}-p{parameters}"
        f"-{digest.hexdigest()[:12]}"
    )


def model_shape(fingerprint: str) -> str:
    """The shape part of a :func:`model_fingerprint` (type, dimensions, parameter count):
    everything but the trailing weight hash."""
    return fingerprint.rsplit("-", 1)[0]


@attrs.frozen
class ProfileKey:
    """Where a profile's timings are valid. Every field but the model name must match."""

    model_name: str
    model_fingerprint: str
    dtype: str
    device: str
    torch_threads: int
    attention_implementation: str
    cache_type: str
    torch_version: str
    transformers_version: str
    knapspec_version: str
    host_cpu: str
    #: The engine's kernel table (``"f.linear"`` or a hash): a profile timed with other
    #: kernels is re-measured. Profiles written before the field existed read as "".
    kernel_table: str = ""

    @classmethod
    def for_engine(cls, engine: SublayerEngine) -> ProfileKey:
        """The key of ``engine``'s model on this machine, with the current thread count."""
        return cls(
            model_name=engine.model_name,
            model_fingerprint=model_fingerprint(engine),
            dtype=str(engine.dtype).removeprefix("torch."),
            device=device_description(engine.device),
            torch_threads=torch.get_num_threads(),
            attention_implementation=ATTENTION_IMPLEMENTATION,
            cache_type=CACHE_TYPE,
            torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            knapspec_version=_library_version("knapspec"),
            host_cpu=host_cpu_model(),
            kernel_table=engine.kernels.fingerprint(),
        )

    def differences(self, other: ProfileKey) -> dict[str, tuple[object, object]]:
        """Fields that must match but do not: ``{field: (self value, other value)}``."""
        return {
            field.name: (getattr(self, field.name), getattr(other, field.name))
            for field in attrs.fields(ProfileKey)
            if field.name not in _INFORMATIONAL_KEY_FIELDS
            and getattr(self, field.name) != getattr(other, field.name)
        }

    def digest(self) -> str:
        """Short stable hash of the fields that must match (used in cache file names)."""
        strict = {k: v for k, v in attrs.asdict(self).items() if k not in _INFORMATIONAL_KEY_FIELDS}
        return hashlib.sha256(json.dumps(strict, sort_keys=True).encode()).hexdigest()[:16]


def _finite_non_negative_seconds(
    instance: object, attribute: attrs.Attribute[Any], value: Any
) -> None:
    def check(x: Any, where: str) -> None:
        if isinstance(x, (tuple, list)):
            for index, element in enumerate(x):
                check(element, f"{where}[{index}]")
            return
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise ProfileError(f"{where} must be a number of seconds, got {x!r}")
        if not math.isfinite(x) or x < 0:
            raise ProfileError(f"{where} must be a finite, non-negative time, got {x!r}")

    check(value, attribute.name)


def _tuple_of_tuples(value: Any) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(row) for row in value)


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen
class VerifyTiming:
    """One verification measurement: a full forward over ``tokens`` new tokens.

    Attributes:
        tokens: tokens in the forward (k = drafted tokens + 1).
        context_length: tokens in the cache before the forward.
        seconds: median wall time, per-step overhead included.
    """

    tokens: int
    context_length: int
    seconds: float = attrs.field(validator=_finite_non_negative_seconds)

    def __attrs_post_init__(self) -> None:
        if self.tokens < 1 or self.context_length < 0:
            raise ProfileError(
                f"verify timing needs tokens >= 1 and context_length >= 0, got "
                f"tokens={self.tokens}, context_length={self.context_length}"
            )


@attrs.frozen
class LatencyProfile:
    """Measured sublayer latencies of one model on one machine (all times in seconds).

    Attributes:
        key: where the timings are valid.
        contexts: ``(C,)`` context lengths of the item ladder, ascending.
        attention_seconds: ``(L, C)`` median time of layer ``i``'s attention item for one
            new token at each context.
        mlp_seconds: ``(L, C)`` median time of layer ``i``'s MLP item, measured at the same
            contexts (it should be flat in context).
        overhead_seconds: ``(C,)`` median time of a step with no item: embedding, rotary,
            final norm, LM head over one token, argmax.
        verify: full-model forwards over ``k`` tokens at several contexts.
        repeats, warmup: measurement settings; quick: a few-seconds profile.
        created: ISO-8601 time of measurement; wall_seconds: how long profiling took.
        schema_version: JSON layout version (:data:`SCHEMA_VERSION`).
        windows: ``(L,)`` the sliding window (tokens) each layer attended with when
            measured, None for a global layer; ``()`` when no layer has one (and in
            profiles written before the field existed). A local layer's attention was
            timed over its window only (:mod:`~knapspec.costmodels.local_layers`).
    """

    key: ProfileKey
    contexts: tuple[int, ...] = attrs.field(converter=_tuple)
    attention_seconds: tuple[tuple[float, ...], ...] = attrs.field(
        converter=_tuple_of_tuples, validator=_finite_non_negative_seconds
    )
    mlp_seconds: tuple[tuple[float, ...], ...] = attrs.field(
        converter=_tuple_of_tuples, validator=_finite_non_negative_seconds
    )
    overhead_seconds: tuple[float, ...] = attrs.field(
        converter=_tuple, validator=_finite_non_negative_seconds
    )
    verify: tuple[VerifyTiming, ...] = attrs.field(converter=_tuple)
    repeats: int = 1
    warmup: int = 0
    quick: bool = False
    created: str = ""
    wall_seconds: float = 0.0
    schema_version: int = SCHEMA_VERSION
    windows: Windows = attrs.field(default=(), converter=normalized_windows)

    def __attrs_post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ProfileError(
                f"profile schema version {self.schema_version} is not supported (this knapspec "
                f"reads version {SCHEMA_VERSION}); re-profile with `knapspec profile`"
            )
        contexts = self.contexts
        if not contexts or any(not isinstance(n, int) or n < 1 for n in contexts):
            raise ProfileError(f"contexts must be positive integers, got {contexts!r}")
        if list(contexts) != sorted(set(contexts)):
            raise ProfileError(f"contexts must be strictly ascending, got {contexts!r}")
        layers = len(self.attention_seconds)
        if layers == 0 or len(self.mlp_seconds) != layers:
            raise ProfileError(
                f"attention_seconds and mlp_seconds need one row per layer; got "
                f"{layers} and {len(self.mlp_seconds)} rows"
            )
        for name, rows in (
            ("attention_seconds", self.attention_seconds),
            ("mlp_seconds", self.mlp_seconds),
        ):
            for layer, row in enumerate(rows):
                if len(row) != len(contexts):
                    raise ProfileError(
                        f"{name}[{layer}] has {len(row)} timings for {len(contexts)} contexts"
                    )
        if len(self.overhead_seconds) != len(contexts):
            raise ProfileError(
                f"overhead_seconds has {len(self.overhead_seconds)} timings for "
                f"{len(contexts)} contexts"
            )
        if not self.verify:
            raise ProfileError("profile holds no verification timings")
        problem = check_windows(self.windows, layers)
        if problem is not None:
            raise ProfileError(problem)

    @property
    def num_layers(self) -> int:
        return len(self.attention_seconds)

    # ------------------------------------------------------------- compatibility
    def check_compatible(self, engine: SublayerEngine, *, force: bool = False) -> None:
        """Refuse this profile for ``engine`` on this machine unless every key field matches.

        ``force`` waives the machine and library fields (and the weights' hash: a
        fine-tune of the same shape times the same), never the model's shape: timings of
        another layer count or width cannot be indexed by this model's layers. Nor the
        sliding windows: a local layer timed over another window (or as a global one)
        would be priced against the wrong context.

        Raises:
            ProfileMismatchError: names the differing fields and how to re-profile or force.
        """
        shape = model_shape(model_fingerprint(engine))
        if self.num_layers != engine.num_layers or model_shape(self.key.model_fingerprint) != shape:
            raise ProfileMismatchError(
                f"latency profile was measured for a model of another shape (the profile: "
                f"{self.num_layers} layers, {model_shape(self.key.model_fingerprint)!r}; this "
                f"model: {engine.num_layers} layers, {shape!r}). force cannot waive the model's "
                "shape: re-profile with `knapspec profile`."
            )
        windows = engine_windows(engine)
        if self.windows != windows:
            raise ProfileMismatchError(
                f"latency profile was measured with other sliding windows (the profile: "
                f"{list(self.windows) or 'none'}; this model: {list(windows) or 'none'}). "
                "force cannot waive them: re-profile with `knapspec profile`."
            )
        if force:
            return
        current = ProfileKey.for_engine(engine)
        differences = current.differences(self.key)
        if not differences:
            return
        lines = "; ".join(
            f"{name}: this machine/model has {mine!r}, the profile {theirs!r}"
            for name, (mine, theirs) in differences.items()
        )
        raise ProfileMismatchError(
            f"latency profile does not match the current model or machine ({lines}). Timings "
            "do not carry over: re-profile with `knapspec profile` (or "
            "knapspec.costmodels.profile_engine(engine).save(path)), or pass force=True "
            "(config `force = true`) to use it anyway."
        )

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the on-disk layout; ``windows`` only when some layer has one,
        so a windowless model's file reads as it did before the field existed)."""
        data: dict[str, Any] = _lists(attrs.asdict(self, recurse=True))
        if not self.windows:
            del data["windows"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "profile") -> LatencyProfile:
        """Parse and validate the on-disk layout.

        Raises:
            ProfileError: wrong schema, missing or mistyped fields, invalid timings.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"{source}: schema_version {version!r} is not supported (expected "
                f"{SCHEMA_VERSION}); re-profile with `knapspec profile`"
            )
        try:
            key = ProfileKey(**data["key"])
            verify = tuple(VerifyTiming(**entry) for entry in data["verify"])
            fields = {k: v for k, v in data.items() if k not in ("key", "verify")}
            return cls(key=key, verify=verify, **fields)
        except ProfileError as error:
            raise ProfileError(f"{source}: {error}") from error
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileError(f"{source}: malformed profile ({error!r})") from error

    def to_json(self) -> str:
        """The on-disk text: :meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON atomically (temporary file, then rename)."""
        target = Path(path)
        replace_atomically(target, self.to_json(), prefix=".profile-")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatencyProfile:
        """Read and validate a profile written by :meth:`save`.

        Raises:
            ProfileError: missing, empty or corrupt file, wrong schema, invalid timings.
        """
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ProfileError(f"cannot read latency profile {source}: {error}") from error
        if not text.strip():
            raise ProfileError(
                f"latency profile {source} is empty; re-profile with `knapspec profile`"
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfileError(
                f"latency profile {source} is not valid JSON ({error}); re-profile with "
                "`knapspec profile`"
            ) from error
        return cls.from_dict(data, source=source)


def _lists(value: Any) -> Any:
    """Tuples to lists, recursively, so the dict is plain JSON data (and editable)."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_lists(v) for v in value]
    return value


__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "CACHE_TYPE",
    "SCHEMA_VERSION",
    "LatencyProfile",
    "ProfileError",
    "ProfileKey",
    "ProfileMismatchError",
    "VerifyTiming",
    "device_description",
    "host_cpu_model",
    "model_fingerprint",
    "model_shape",
]
