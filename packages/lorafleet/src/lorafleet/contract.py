"""The rules every service shares: losses, optimizer ranges, LoRA options, ids.

One owner per rule. The gateway validates requests with these, the controller validates
submissions with these, and the trainer computes with these; nothing restates them, so a
loss the trainer implements is a loss the gateway accepts (a test asserts it). Torch-free
and grpc-free on purpose: the gateway and controller import it without pulling torch.
Tensor dtype tables live next door in `lorafleet.tensors`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol, Self

from lorafleet import names
from lorafleet.errors import InvalidArgument, LorafleetError

# --- losses ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss: the `loss_fn_inputs` it needs, those it may take, and its config keys
    with their defaults (tinker-api.md §7.3). `topk_targets`: its targets may be top-K,
    (N, K), with weights of the same shape; every other input is one value per position."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: Mapping[str, float] = field(default_factory=dict)
    topk_targets: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required + self.optional


DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05
_CLIP = {"clip_low_threshold": DEFAULT_CLIP_LOW, "clip_high_threshold": DEFAULT_CLIP_HIGH}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: Mapping[str, LossSpec] = {
    spec.name: spec
    for spec in (
        # Omitted weights are ones of the target's shape, as the hosted service fills them.
        LossSpec("cross_entropy", ("target_tokens",), ("weights",), topk_targets=True),
        LossSpec("importance_sampling", _RL_INPUTS),
        LossSpec("ppo", _RL_INPUTS, config=_CLIP),
        LossSpec("cispo", _RL_INPUTS, config=_CLIP),
        LossSpec("dro", _RL_INPUTS, config={"beta": DEFAULT_DRO_BETA}),
        LossSpec("gspo", _RL_INPUTS, ("sequence_ratio_mask",), config=_CLIP),
    )
}
LOSS_NAMES: tuple[str, ...] = tuple(LOSSES)
# Integer-valued loss inputs (token ids); every other input is float32.
INT_INPUTS = frozenset({"target_tokens"})
# Names Tinker defines that this server refuses on purpose, with the reason users see.
REFUSED_LOSSES: Mapping[str, str] = {
    "dimuon": "dimuon is not supported by lorafleet (no reference implementation to match)",
}
# Per-token outputs every built-in loss returns, per datum, with the target's leading shape.
LOSS_OUTPUTS = ("logprobs", "elementwise_loss")


def loss_spec(name: str, field: str = "loss_fn") -> LossSpec:
    """The spec of a built-in loss, or InvalidArgument listing the supported ones."""
    spec = LOSSES.get(name)
    if spec is not None:
        return spec
    if name in REFUSED_LOSSES:
        raise InvalidArgument(REFUSED_LOSSES[name], field=field)
    raise InvalidArgument(
        f"unknown or unsupported loss {name!r} (supported: {', '.join(LOSS_NAMES)})", field=field
    )


def loss_config(
    name: str, config: Mapping[str, float], field: str = "loss_fn_config"
) -> dict[str, float]:
    """The loss's config with defaults filled in; unknown keys and non-finite values refused."""
    spec = loss_spec(name)
    out = dict(spec.config)
    for key, value in config.items():
        if key not in spec.config:
            known = ", ".join(spec.config) or "none"
            raise InvalidArgument(
                f"unknown key for {name} (known: {known})", field=f"{field}.{key}"
            )
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidArgument(f"must be a finite number, got {value!r}", field=f"{field}.{key}")
        out[key] = float(value)
    lo, hi = out.get("clip_low_threshold"), out.get("clip_high_threshold")
    if lo is not None and lo < 0:
        raise InvalidArgument("must be >= 0", field=f"{field}.clip_low_threshold")
    if lo is not None and hi is not None and hi < lo:
        raise InvalidArgument("must be >= clip_low_threshold", field=f"{field}.clip_high_threshold")
    if out.get("beta", 0.0) < 0:
        raise InvalidArgument("must be >= 0", field=f"{field}.beta")
    return out


# --- optimizer ------------------------------------------------------------------------------

# AdamParams field → (predicate, rule text). All values must also be finite.
ADAM_RULES: Mapping[str, tuple[Callable[[float], bool], str]] = {
    "learning_rate": (lambda v: v >= 0, ">= 0"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "eps": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "grad_clip_norm": (lambda v: v >= 0, ">= 0 (0 = no clipping)"),
}
# Tinker's AdamParams defaults (the SDK always sends every field; these fill a bare request).
ADAM_DEFAULTS: Mapping[str, float] = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
OPTIMIZERS = ("adamw",)


def check_adam(values: Mapping[str, float | None], field: str = "adam_params") -> None:
    """Every AdamParams value finite and in range, checked before anything moves; a value
    left unset (None: grad_clip_norm falls back to the run's default) is not checked."""
    for name, (ok, rule) in ADAM_RULES.items():
        raw = values.get(name)
        if raw is None:
            continue
        value = float(raw)
        if not math.isfinite(value) or not ok(value):
            raise InvalidArgument(
                f"must be finite and {rule}, got {value!r}", field=f"{field}.{name}"
            )


# --- LoRA options ---------------------------------------------------------------------------

DEFAULT_RANK = 32
MAX_RANK = 1024
DEFAULT_ALPHA = 32.0  # scale = alpha / rank; a LoraConfig alpha of 0 means this
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraOptions:
    """The LoRA options a registration may set beyond Tinker's rank/seed/train_* flags.

    Users reach them through `user_metadata` keys `lorafleet.<name>` (a Tinker SDK call has no
    other field for them); server-wide defaults come from settings.
    """

    alpha: float = DEFAULT_ALPHA
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    lora_plus_ratio: float = 1.0
    a_only_weight_decay: bool = False
    max_grad_norm_default: float = 0.0


METADATA_PREFIX = "lorafleet."
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _number(key: str, raw: str, ok: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"not a number: {raw!r}", field=f"user_metadata.{key}") from None
    if not math.isfinite(value) or not ok(value):
        raise InvalidArgument(f"must be {rule}, got {raw!r}", field=f"user_metadata.{key}")
    return value


def _modules(key: str, raw: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    bad = [n for n in names if not _MODULE_RE.match(n)]
    if not names or bad:
        raise InvalidArgument(
            f"expected a comma-separated list of module names, got {raw!r}",
            field=f"user_metadata.{key}",
        )
    return names


def _flag(key: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low not in ("true", "false", "1", "0"):
        raise InvalidArgument(f"must be true or false, got {raw!r}", field=f"user_metadata.{key}")
    return low in ("true", "1")


# A LoRA option's value as a user gives it (user_metadata, a managed job's parameters) →
# (predicate, rule text). The wire's LoraConfig reads 0 as "unset" (LORA_RULES below).
OPTION_RULES: Mapping[str, tuple[Callable[[float], bool], str]] = {
    "alpha": (lambda x: x > 0, "> 0"),
    "dropout": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "lora_plus_ratio": (lambda x: x > 0, "> 0"),
    "max_grad_norm_default": (lambda x: x >= 0, ">= 0"),
}


def _ranged(rule: tuple[Callable[[float], bool], str]) -> Callable[[str, str], float]:
    return lambda key, raw: _number(key, raw, *rule)


_OPTION_PARSERS: Mapping[str, Callable[[str, str], object]] = {
    **{name: _ranged(rule) for name, rule in OPTION_RULES.items()},
    "target_modules": _modules,
    "exclude_modules": _modules,
    "a_only_weight_decay": _flag,
}
LORA_OPTION_KEYS = tuple(METADATA_PREFIX + name for name in _OPTION_PARSERS)


def split_lora_options(
    metadata: Mapping[str, str], defaults: LoraOptions = LoraOptions()
) -> tuple[LoraOptions, dict[str, str]]:
    """`user_metadata` → (LoRA options, the user's own metadata).

    `lorafleet.*` keys are options, validated with an error naming the key; an unknown
    `lorafleet.*` key is refused (a typo must not silently train with defaults). Other keys
    are the user's and are stored as given.
    """
    values: dict[str, object] = {}
    user: dict[str, str] = {}
    for key, raw in metadata.items():
        if not key.startswith(METADATA_PREFIX):
            user[key] = raw
            continue
        name = key[len(METADATA_PREFIX) :]
        parse = _OPTION_PARSERS.get(name)
        if parse is None:
            raise InvalidArgument(
                f"unknown lorafleet option (known: {', '.join(LORA_OPTION_KEYS)})",
                field=f"user_metadata.{key}",
            )
        values[name] = parse(key, str(raw))
    options = LoraOptions(**{**defaults.__dict__, **values})
    overlap = set(options.target_modules) & set(options.exclude_modules)
    if overlap:
        raise InvalidArgument(
            f"modules both targeted and excluded: {sorted(overlap)}",
            field="user_metadata.lorafleet.exclude_modules",
        )
    return options, user


def check_rank(rank: int, max_rank: int = 0, field: str = "lora_config.rank") -> None:
    """Rank in [1, max_rank]; `max_rank` is the serving trainers' (capabilities), 0 when no
    trainer has said yet (then MAX_RANK bounds it)."""
    limit = max_rank or MAX_RANK
    if not 1 <= rank <= limit:
        raise InvalidArgument(f"must be in [1, {limit}], got {rank}", field=field)


def check_num_samples(n: int, limit: int, field: str = "num_samples") -> None:
    """A sample request's num_samples in [1, limit]; `limit` is the rollouts' setting, as
    they announce it (capabilities), never a constant: a request the rollout would refuse
    is refused when it is submitted."""
    if not 1 <= n <= limit:
        raise InvalidArgument(f"{n} is outside [1, {limit}]", field=field)


def effective_alpha(alpha: float) -> float:
    """A LoraConfig's alpha; 0 (a proto field left unset) means DEFAULT_ALPHA."""
    return alpha or DEFAULT_ALPHA


def b_lr_ratio(lora_plus_ratio: float) -> float:
    """LoRA+'s B learning-rate ratio; 0 (a proto field left unset) means 1.0 (plain LoRA)."""
    return lora_plus_ratio or 1.0


class LoraConfigLike(Protocol):
    """The LoRA fields of a v1 `LoraConfig` message (or the trainer's LoraSpec)."""

    @property
    def rank(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def dropout(self) -> float: ...
    @property
    def lora_plus_ratio(self) -> float: ...
    @property
    def max_grad_norm_default(self) -> float: ...
    @property
    def seed(self) -> int: ...


# LoraConfig field → (predicate, rule text) as it travels: alpha and lora_plus_ratio 0 mean
# "unset" (DEFAULT_ALPHA, plain LoRA), so the wire rule is >= 0 where the user's is > 0.
LORA_RULES: Mapping[str, tuple[Callable[[float], bool], str]] = {
    "alpha": (lambda v: v >= 0, f">= 0 (0 = default {DEFAULT_ALPHA:g})"),
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora_plus_ratio": (lambda v: v >= 0, ">= 0 (0 = 1, plain LoRA)"),
    "max_grad_norm_default": (lambda v: v >= 0, ">= 0 (0 = none)"),
}


def check_lora_config(config: LoraConfigLike, max_rank: int, field: str = "lora_config") -> None:
    """The validator of a v1 `LoraConfig` (CreateRegistration, BindSlot): the gateway calls it
    to answer 400, the trainer before it binds. `max_rank` comes from capabilities."""
    check_rank(config.rank, max_rank, f"{field}.rank")
    check_seed(config.seed, f"{field}.seed")
    for name, (ok, rule) in LORA_RULES.items():
        value = float(getattr(config, name))
        if not math.isfinite(value) or not ok(value):
            raise InvalidArgument(
                f"must be finite and {rule}, got {value!r}", field=f"{field}.{name}"
            )


# --- target modules -------------------------------------------------------------------------

# juno names its targets wq,wk,...; they are refused with this hint rather than mapped, so a
# module name means one thing everywhere (PEFT export, rollouts, the run's lora_config).
JUNO_TARGETS: Mapping[str, str] = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "wgate": "gate_proj",
    "wup": "up_proj",
    "wdown": "down_proj",
}


def module_matches(module: str, pattern: str) -> bool:
    """PEFT's rule: a pattern names a module by its full dotted name or a dotted suffix."""
    return module == pattern or module.endswith("." + pattern)


def check_target_names(names: Sequence[str], modules: Sequence[str], field: str) -> None:
    """Every name (or `all-linear`) must name one of `modules`, the base model's adaptable
    modules as its trainers report them (capabilities). All unknown names are reported at
    once, with the valid short names: a typo must fail at once, not at bind time."""
    unknown = [
        n for n in names if n != ALL_LINEAR and not any(module_matches(m, n) for m in modules)
    ]
    if not unknown:
        return
    valid = sorted({m.rsplit(".", 1)[-1] for m in modules})
    hints = [f"{n} is {JUNO_TARGETS[n]}" for n in unknown if n in JUNO_TARGETS]
    hint = f"; juno's {', '.join(hints)} here" if hints else ""
    raise InvalidArgument(
        f"unknown module name(s) {', '.join(repr(n) for n in unknown)} for this base model "
        f"(valid: {', '.join(valid)}, {ALL_LINEAR}, or a full dotted name){hint}",
        field=field,
    )


class TargetsLike(Protocol):
    @property
    def target_modules(self) -> Sequence[str]: ...
    @property
    def exclude_modules(self) -> Sequence[str]: ...


def check_lora_targets(
    config: TargetsLike, modules: Sequence[str], prefix: str = f"user_metadata.{METADATA_PREFIX}"
) -> None:
    """A registration's target and exclude lists (LoraOptions, or a checkpoint's LoraConfig)
    against the base model's modules, the fields named `<prefix>target_modules`; an empty
    `modules` means no trainer has reported them yet, and the trainer checks at bind."""
    if not modules:
        return
    check_target_names(config.target_modules, modules, f"{prefix}target_modules")
    check_target_names(config.exclude_modules, modules, f"{prefix}exclude_modules")


# --- sampling seeds -------------------------------------------------------------------------

#: Seeds a sampling request may carry: Tinker's `optional uint64 seed`, so [0, 2**64).
SEED_LIMIT = 2**64
#: Seeds an engine is handed: [0, 2**63). SGLang refuses a sampling_seed >= 2**63
#: (`srt/sampling/sampling_params.py`); vLLM's seed and torch generators are int64.
ENGINE_SEED_LIMIT = 2**63
#: Sample i of a seeded request draws with `seed ^ (i * stride)`. The stride is odd, so
#: i -> i * stride is a bijection modulo 2**63 and one request's samples get distinct seeds;
#: its golden-ratio bits spread neighbouring indices over the whole range.
SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15


def check_seed(seed: int | None, field: str = "sampling_params.seed") -> None:
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidArgument(f"seed {seed} is outside [0, 2**64)", field=field)


def sample_seed(seed: int, index: int) -> int:
    """The engine seed of sample `index` (0-based) of a request seeded with `seed`.

    Reproducible, distinct across one request's samples (engines that share one seed between
    the n copies of a request, as SGLang does, would return n identical samples) and within
    [0, ENGINE_SEED_LIMIT): seeds are taken modulo 2**63, so s and s + 2**63 draw alike.
    """
    check_seed(seed)
    return (seed ^ (index * SAMPLE_SEED_STRIDE)) % ENGINE_SEED_LIMIT


# --- failed runs ----------------------------------------------------------------------------


def run_failure_json(run_id: str, exc: LorafleetError) -> str:
    """The stored form of a run its trainer refused to bind (Registration.failed)."""
    return json.dumps(
        {"field": exc.field, "message": f"training run {run_id} failed: {exc.message}"}
    )


def run_failure(stored: str) -> InvalidArgument:
    """The error every call on a failed run ends with: the trainer's refusal, naming its
    field, kept as an InvalidArgument (retrying cannot fix it)."""
    info = json.loads(stored)
    return InvalidArgument(info["message"], field=info["field"], reason="RUN_FAILED")


# --- ids ------------------------------------------------------------------------------------

TINKER_SCHEME = "tinker://"


class CheckpointKind(StrEnum):
    """The middle part of a tinker path."""

    WEIGHTS = "weights"
    SAMPLER_WEIGHTS = "sampler_weights"
    EXTERNAL_WEIGHTS = "external_weights"


@dataclass(frozen=True)
class TinkerPath:
    """`tinker://<run>/<kind>/<name>`, exactly three parts, as the SDK parses it."""

    run_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.kind.value}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind.value}/{self.name}"

    @classmethod
    def from_parts(cls, run_id: str, kind: str, name: str, field: str = "path") -> TinkerPath:
        """A path from a URL's parts, checked as a whole path is (400 naming `field`)."""
        return cls.parse(f"{TINKER_SCHEME}{run_id}/{kind}/{name}", field)

    @classmethod
    def parse(cls, path: str, field: str = "path") -> TinkerPath:
        parts = (
            path.removeprefix(TINKER_SCHEME).split("/") if path.startswith(TINKER_SCHEME) else []
        )
        kinds = [k.value for k in CheckpointKind]
        if len(parts) != 3 or not all(parts) or parts[1] not in kinds:
            raise InvalidArgument(
                f"{path[:80]!r} is not a tinker://<run>/<{'|'.join(kinds)}>/<name> path",
                field=field,
            )
        names.check_name(parts[2], field)
        return cls(names.check_run_id(parts[0], field), CheckpointKind(parts[1]), parts[2])


@dataclass(frozen=True)
class RunId:
    """A training run's Tinker model id (= registration id), `<session>:train:<n>`: the
    session's n-th model, so a client's retried create_model names the same run."""

    session_id: str
    seq: int
    SEP: ClassVar[str] = ":train:"
    WHAT: ClassVar[str] = "training run"

    def __str__(self) -> str:
        return f"{self.session_id}{self.SEP}{self.seq}"

    @classmethod
    def parse(cls, text: str, field: str = "model_id") -> Self:
        session, sep, seq = text.rpartition(cls.SEP)
        if not sep or not session or not seq.isdigit():
            raise InvalidArgument(f"{text!r} is not a {cls.WHAT} id", field=field)
        return cls(session, int(seq))


@dataclass(frozen=True)
class SamplerId(RunId):
    """A sampling client's id, `<session>:sample:<n>`."""

    SEP: ClassVar[str] = ":sample:"
    WHAT: ClassVar[str] = "sampler"


@dataclass(frozen=True)
class AdapterId:
    """A registration-scoped, version-pinned adapter id, `<registration>@<version>`: a new
    registration never reuses an old one's id (anti-ABA), and a sampler pins one version."""

    registration_id: str
    version: int

    def __str__(self) -> str:
        return f"{self.registration_id}@{self.version}"

    @classmethod
    def parse(cls, text: str, field: str = "adapter_id") -> AdapterId:
        rid, sep, version = text.rpartition("@")
        if not sep or not rid or "/" in rid or not version.isdigit():
            raise InvalidArgument(f"{text!r} is not '<registration>@<version>'", field=field)
        return cls(rid, int(version))


class FutureKind(StrEnum):
    """What a Tinker future id stands for. Most are ledger operations; creating and unloading
    a model are answered from the registry, and a weights export names its checkpoint."""

    OPERATION = "op"
    CREATE = "create"
    UNLOAD = "unload"
    EXTERNAL = "external"


@dataclass(frozen=True)
class FutureId:
    """A Tinker `request_id` as a typed value; `str()` is its wire form `<kind>:<ref>[:<name>]`.

    `ref` is an operation id (OPERATION, EXTERNAL) or a model id (CREATE, UNLOAD); `name` is
    the external checkpoint's name. Model ids contain ':' so the name goes last and the ref
    is whatever lies between.
    """

    kind: FutureKind
    ref: str
    name: str = ""

    def __str__(self) -> str:
        if self.kind is FutureKind.EXTERNAL:
            return f"{self.kind.value}:{self.name}:{self.ref}"
        return f"{self.kind.value}:{self.ref}"

    @classmethod
    def parse(cls, text: str, field: str = "request_id") -> FutureId:
        kind_text, sep, rest = text.partition(":")
        try:
            kind = FutureKind(kind_text)
        except ValueError:
            kind = None
        if not sep or kind is None or not rest:
            raise InvalidArgument(f"{text!r} is not a request id this server issued", field=field)
        if kind is FutureKind.EXTERNAL:
            name, sep, ref = rest.partition(":")
            if not sep or not name or not ref:
                raise InvalidArgument(
                    f"{text!r} is not a request id this server issued", field=field
                )
            return cls(kind, ref, name)
        return cls(kind, rest)
