"""A rule the contract owns is never spelled again in a service.

`lorafleet.contract` owns the losses, the AdamParams and LoraConfig ranges and defaults, the
LoRA option names, the module-name matching rule, deployment limits (which come from
capabilities) and the Tinker id formats. This test reads every service's and package's
source (the AST, not running it) and fails on the shapes a restated rule takes: an id built
or split by hand, a default written as `alpha or 32.0`, a list of loss names, Adam constants,
a rank bound, PEFT's suffix rule, the old option name. Each finding names the file, the line
and the contract name to use instead. `test_the_scan_finds_each_shape` proves every check
can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

from lorafleet import contract

REPO = Path(__file__).resolve().parents[3]
ROOTS = ("services", "packages")
OWNERS = {
    Path("packages/lorafleet/src/lorafleet/contract.py"),
    Path("packages/lorafleet/src/lorafleet/validate_msgs.py"),
}
ID_PARTS = (contract.TINKER_SCHEME, contract.RunId.SEP, contract.SamplerId.SEP)
DEFAULTED = {"alpha": "contract.effective_alpha", "lora_plus_ratio": "contract.b_lr_ratio"}
RETIRED_NAMES = {"a_only_decay": "a_only_weight_decay"}

Check = Callable[[ast.AST], str | None]


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _number(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def built_id(node: ast.AST) -> str | None:
    """f"tinker://{run}/..." or f"{session}:train:{n}": an id built by hand."""
    if not isinstance(node, ast.JoinedStr):
        return None
    parts = node.values
    for i, part in enumerate(parts):
        if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
            continue
        before = i > 0 and isinstance(parts[i - 1], ast.FormattedValue)
        after = i + 1 < len(parts) and isinstance(parts[i + 1], ast.FormattedValue)
        for id_part in ID_PARTS:
            if (part.value.endswith(id_part) and after) or (
                part.value.startswith(id_part) and before
            ):
                return f"builds an id with {id_part!r}: use contract.TinkerPath/RunId/SamplerId"
    return None


def split_id(node: ast.AST) -> str | None:
    """x.split(":train:") and its kind: an id parsed by hand."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr not in ("split", "rsplit", "partition", "rpartition", "removeprefix"):
        return None
    for arg in node.args:
        if isinstance(arg, ast.Constant) and arg.value in ID_PARTS:
            return f"parses an id on {arg.value!r}: use contract.TinkerPath/RunId/SamplerId.parse"
    return None


def defaulted(node: ast.AST) -> str | None:
    """`cfg.alpha or 32.0`: a LoraConfig default restated."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
        field, default = node.values
        owner = DEFAULTED.get(_name(field))
        if owner and (_number(default) or isinstance(default, ast.Constant)):
            return f"restates the default of {_name(field)}: use {owner}"
    return None


def loss_list(node: ast.AST) -> str | None:
    """("ppo", "cispo", ...): the loss table restated."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if sum(1 for n in names if n in contract.LOSSES) >= 2:
            return "lists loss names: use contract.LOSSES / LOSS_NAMES"
    return None


def adam_constant(node: ast.AST) -> str | None:
    """AdamParams(beta1=0.9, ...): Tinker's Adam defaults restated."""
    if isinstance(node, ast.Call):
        for kw in node.keywords:
            if kw.arg in ("beta1", "beta2", "eps") and _number(kw.value):
                return f"writes {kw.arg} as a number: use contract.ADAM_DEFAULTS"
    return None


LIMITED = {"rank": "contract.check_rank", "num_samples": "contract.check_num_samples"}


def limit_bound(node: ast.AST) -> str | None:
    """`rank <= 1024`, `n > 1024`: a deployment limit restated (it comes from capabilities)."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        limited = [k for s in sides for k in LIMITED if _name(s).endswith(k)]
        if limited and any(_number(s) and s.value > 1 for s in sides):  # type: ignore[attr-defined]
            return f"bounds {limited[0]} with a number: use {LIMITED[limited[0]]}"
    if isinstance(node, ast.AnnAssign) and _name(node.target) in LIMITED:
        for kw in ast.walk(node.annotation):
            if isinstance(kw, ast.keyword) and kw.arg in ("le", "lt") and _number(kw.value):
                name = _name(node.target)
                return f"bounds {name} with a number: use {LIMITED[name]}"
    return None


# Options whose ranges the contract owns (OPTION_RULES, ADAM_RULES). A managed job's
# learning rate is its own rule (> 0: a job that cannot move is refused), not Adam's >= 0.
RANGED = (set(contract.OPTION_RULES) | set(contract.ADAM_RULES)) - {"learning_rate"}


def option_range(node: ast.AST) -> str | None:
    """{"alpha": _number(float, lambda v: v > 0, "> 0")}: an option's range restated."""
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if (
                isinstance(key, ast.Constant)
                and key.value in RANGED
                and any(isinstance(n, ast.Lambda) for n in ast.walk(value))
            ):
                return f"restates the range of {key.value}: use contract.OPTION_RULES/ADAM_RULES"
    return None


def seed_bound(node: ast.AST) -> str | None:
    """`seed < 2**64`: the uint64 seed range restated."""
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            if (
                isinstance(side, ast.BinOp)
                and isinstance(side.op, ast.Pow)
                and isinstance(side.right, ast.Constant)
                and side.right.value in (63, 64)
            ):
                return "bounds a seed by 2**64: use contract.check_seed / SEED_LIMIT"
    return None


def suffix_rule(node: ast.AST) -> str | None:
    """m.endswith("." + pattern): PEFT's module-name rule restated."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "endswith"
        and node.args
        and isinstance(node.args[0], ast.BinOp)
        and isinstance(node.args[0].left, ast.Constant)
        and node.args[0].left.value == "."
    ):
        return "matches module names by suffix: use contract.module_matches"
    return None


def retired_name(node: ast.AST) -> str | None:
    """The LoRA option's old name, as an identifier or a key."""
    text = (
        node.value
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        else node.attr
        if isinstance(node, ast.Attribute)
        else node.id
        if isinstance(node, ast.Name)
        else ""
    )
    for old, new in RETIRED_NAMES.items():
        if text == old or text.endswith("." + old):
            return f"uses {old!r}: the option is called {new!r}"
    return None


# Fields whose rules `lorafleet.validate_msgs` owns for the v1 SampleRequest and
# ForwardBackwardInput: a service raising an error on one of them restates that rule.
MESSAGE_FIELDS = {
    "params.max_tokens",
    "params.temperature",
    "params.top_p",
    "params.top_k",
    "topk_prompt_logprobs",
    "group_tokens",
    "data",
}


# A datum's fields, as a field name built for one datum ends (f"{where}.tokens").
DATUM_FIELDS = (".tokens", ".context", ".loss_fn_inputs")


def message_rule(node: ast.AST) -> str | None:
    """InvalidArgument(..., field="params.top_k") or field=f"data[{j}].tokens": a v1
    message's check restated."""
    if not isinstance(node, ast.Call):
        return None
    for kw in node.keywords:
        value = kw.value
        if kw.arg != "field":
            continue
        if isinstance(value, ast.Constant) and value.value in MESSAGE_FIELDS:
            return f"checks {value.value!r}: use lorafleet.validate_msgs"
        if isinstance(value, ast.JoinedStr):
            text = "".join(v.value for v in value.values if isinstance(v, ast.Constant))
            # A v1 datum has no chunks: a field naming them decodes the SDK's ModelInput.
            if any(part in text for part in DATUM_FIELDS) and ".chunks[" not in text:
                return f"checks a datum's {text!r}: use lorafleet.validate_msgs"
    return None


# A token id checked against the vocabulary (`t >= vocab_size`, `0 <= t < vocab_size`), a
# length against the context (`n > max_context_length`): the message validator's rules.
BOUNDS = {
    "vocab_size": (ast.Lt, ast.GtE),
    "max_context_length": (ast.Gt, ast.LtE),
    "max_length": (ast.Gt, ast.LtE),
}


def message_bound(node: ast.AST) -> str | None:
    """`tok >= vocab_size`, `n + len(context) > max_length`: validate_msgs' bounds restated."""
    if not isinstance(node, ast.Compare):
        return None
    for op, right in zip(node.ops, node.comparators, strict=True):
        ops = BOUNDS.get(_name(right))
        if ops and isinstance(op, ops):
            return f"bounds a value by {_name(right)}: use lorafleet.validate_msgs"
    return None


CHECKS: tuple[Check, ...] = (
    built_id,
    split_id,
    defaulted,
    loss_list,
    adam_constant,
    limit_bound,
    option_range,
    seed_bound,
    suffix_rule,
    retired_name,
    message_rule,
    message_bound,
)


def _sources() -> Iterator[Path]:
    for root in ROOTS:
        for path in sorted((REPO / root).glob("*/src/**/*.py")):
            rel = path.relative_to(REPO)
            if rel in OWNERS or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            yield rel


def findings(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        for check in CHECKS:
            if (why := check(node)) is not None:
                out.append(f"{where}:{getattr(node, 'lineno', 0)}: {why}")
    return out


def test_no_service_restates_a_contract_rule() -> None:
    sources = list(_sources())
    assert len(sources) > 100  # the scan reads the whole tree, not an empty glob
    found = [f for rel in sources for f in findings((REPO / rel).read_text(), str(rel))]
    assert not found, "\n".join(found)


def test_the_scan_finds_each_shape() -> None:
    """Every check fires on the shape it names (so the test above can fail)."""
    shapes = {
        built_id: 'path = f"tinker://{rid}/weights/{name}"',
        split_id: 'session = rid.split(":train:")[0]',
        defaulted: "alpha = cfg.alpha or 32.0",
        loss_list: 'LOSSES = ("ppo", "cispo")',
        adam_constant: "AdamParams(beta1=0.9)",
        limit_bound: "num_samples: Annotated[int, Field(ge=1, le=1024)] = 1",
        option_range: 'PARSERS = {"alpha": _number(float, lambda v: v > 0, "> 0")}',
        seed_bound: "if not 0 <= spec.seed < 2**64: pass",
        suffix_rule: 'm.endswith("." + pattern)',
        retired_name: 'options["a_only_decay"]',
        message_rule: 'raise InvalidArgument("bad", field="params.top_k")',
        message_bound: "bad = next((t for t in ids if not 0 <= t < vocab_size), None)",
    }
    assert set(shapes) == set(CHECKS)
    for check, line in shapes.items():
        assert any(check(node) for node in ast.walk(ast.parse(line))), (check.__name__, line)
    assert any(limit_bound(n) for n in ast.walk(ast.parse("ok = 1 <= lora.rank <= 1024")))
    assert not findings('msg = f"not tinker://<run>/weights/<name>: {path}"', "probe")
    # The shapes the trainer's prepare_input had before it called the shared validator.
    for line in (
        'raise InvalidArgument("empty", field=f"{field}.tokens")',
        'raise InvalidArgument("bad", field=f"data[{j}].loss_fn_inputs.{key}")',
        "if n + len(datum.context) > max_length: pass",
        "bad = bool(((targets < 0) | (targets >= vocab_size)).any())",
    ):
        assert findings(line, "probe"), line
    assert not findings("if tokenizer_size > vocab_size: pass", "probe")
    assert not findings('raise InvalidArgument("", field=f"{f}.chunks[{j}].tokens")', "probe")
