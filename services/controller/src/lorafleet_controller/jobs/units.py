"""From pairs and documents to training units: what a job feeds the trainer.

A *unit* is what the validation split holds out whole and what a pass shuffles: one
phrasing of a Q&A pair, or one document. A unit is made of *chunks*, one datum each: a
phrasing is one chunk; a document is cut into windows of `chunk_tokens` (truncated BPTT:
each window names the document tokens it reads before itself as `context`; the trainer
reads their keys/values, detached, carried from the window before: trainer/bptt.py). All
of it is a pure function of the data, the parameters, the tokenizer and the model's
positions, so a resumed job rebuilds exactly the units it started with.

Documents of any length: a window's context starts where its *segment* starts. When a
window would not fit in the model's positions after its context, the context shifts
(juno's context shift: drop the oldest tokens and keep going, here with the kept tokens
recomputed rather than re-rotated): it keeps only the document's last `shift_keep` tokens
before the window, which the trainer computes again from position 0, and the windows after
it carry as before. A shift recomputes `shift_keep` (positions / 16) tokens once per more
than positions − positions / 16 − chunk_tokens new ones: a long document in 32-token
windows on 512 positions costs 1.064 forward tokens per token, and a window after the
first always reads at least `shift_keep` tokens before it.

Q&A (juno §11.6): each pair becomes four phrasings of the question (generalisation), each
rendered with the model's chat template as a user turn and an assistant turn. The loss is
completion-only: only the answer's tokens and the template's turn-end token that closes the
assistant turn (`<|im_end|>`, `</s>`, `<|end|>`, ...) are trained, so the model learns to
answer and to stop, not to produce the question. A tokenizer without a chat template cannot
do this and is refused.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet_controller.jobs.data import Pair

# The four phrasings of a question (juno trains every fact under four). The first is the
# question as asked; the others wrap it the ways people ask, so the fact is recalled from
# more than one exact prompt.
PHRASINGS = (
    "{q}",
    "Please answer this question: {q}",
    "I'd like to know something. {q}",
    "Quick question: {q}",
)

# Chat-template families, recognised by a marker in the template text; named in results
# because a template mismatch between training and use is the first thing to check.
TEMPLATE_FAMILIES = (
    ("chatml", "<|im_start|>"),
    ("llama3", "<|start_header_id|>"),
    ("gemma", "<start_of_turn>"),
    ("phi3", "<|end|>"),
    ("mistral", "[INST]"),
    ("zephyr", "<|assistant|>"),
)


class Codec(Protocol):
    """The tokenizer a job needs (see `jobs.tokenizer`)."""

    chat_template: str | None
    special_tokens: Sequence[str]

    def encode(self, text: str) -> list[int]: ...

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...


@dataclass(frozen=True)
class Chunk:
    """One datum: `tokens` in, `targets` predicted (same length), `mask` 1 where trained."""

    tokens: tuple[int, ...]
    targets: tuple[int, ...]
    mask: tuple[int, ...]
    context: tuple[int, ...] = ()
    window: bool = False  # a document's window: the trainer keeps its keys/values for the next

    @property
    def prediction_tokens(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Unit:
    group: int  # the pair or document it came from: the split keeps a group together
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Plan:
    """Every unit of a job, split into training and validation."""

    train: tuple[Unit, ...]
    validation: tuple[Unit, ...]
    group_count: int  # pairs or documents
    unit_count: int  # phrasings or documents, before the split
    chat_template: str = ""
    dropped_chunks: int = 0  # left out by max_train_tokens

    def chunk_count(self) -> int:
        return sum(len(u.chunks) for u in self.train)

    def updates_per_pass(self, accumulation: int) -> int:
        return -(-self.chunk_count() // accumulation)

    def pass_groups(self, pass_index: int, seed: int, accumulation: int) -> list[list[Chunk]]:
        """A pass's accumulation groups: the training units in a seeded order (windows of a
        document stay in order), `accumulation` chunks per optimizer update."""
        order = list(self.train)
        random.Random(f"{seed}:pass:{pass_index}").shuffle(order)
        chunks = [c for unit in order for c in unit.chunks]
        return [chunks[i : i + accumulation] for i in range(0, len(chunks), accumulation)]


def template_family(template: str) -> str:
    for name, marker in TEMPLATE_FAMILIES:
        if marker in template:
            return name
    return "custom"


def require_template(codec: Codec) -> str:
    """The family name of the codec's chat template; FailedPrecondition without one."""
    if not codec.chat_template:
        raise FailedPrecondition(
            "the base model's tokenizer has no chat template, so Q&A pairs cannot be "
            "formatted as conversations; train documents instead (/v1/lora/train)",
            field="base_model",
            reason="NO_CHAT_TEMPLATE",
        )
    return template_family(codec.chat_template)


def qa_chunk(codec: Codec, question: str, answer: str) -> Chunk:
    """One chat-templated exchange, trained on the answer and the turn-end token only.

    The prompt is the user turn plus the template's generation prompt; the completion is
    what the full conversation adds after it, cut right after the first special token that
    follows the answer (the turn end). Prompt and completion are tokenised separately, so
    the mask boundary is exact whatever the tokenizer merges.
    """
    user = {"role": "user", "content": question}
    prompt = codec.render([user], add_generation_prompt=True)
    full = codec.render([user, {"role": "assistant", "content": answer}], False)
    if not full.startswith(prompt):
        raise FailedPrecondition(
            "the chat template renders the assistant turn without its generation prompt",
            field="base_model",
            reason="UNSUPPORTED_CHAT_TEMPLATE",
        )
    completion = full[len(prompt) :]
    at = completion.find(answer)
    if at < 0:
        raise FailedPrecondition(
            "the chat template changes the answer text",
            field="base_model",
            reason="UNSUPPORTED_CHAT_TEMPLATE",
        )
    after = at + len(answer)
    ends = [(completion.find(t, after), t) for t in codec.special_tokens if t]
    ends = [(i, t) for i, t in ends if i >= 0]
    if not ends:
        raise FailedPrecondition(
            "the chat template closes the assistant turn with no special token",
            field="base_model",
            reason="UNSUPPORTED_CHAT_TEMPLATE",
        )
    i, token = min(ends)
    prompt_ids = codec.encode(prompt)
    completion_ids = codec.encode(completion[: i + len(token)])
    ids = prompt_ids + completion_ids
    mask = [0] * (len(prompt_ids) - 1) + [1] * len(completion_ids)
    return Chunk(tuple(ids[:-1]), tuple(ids[1:]), tuple(mask))


def qa_units(codec: Codec, pairs: Sequence[Pair], positions: int) -> list[Unit]:
    """Four units per pair, one per phrasing, grouped by pair; each within `positions`."""
    out = []
    for i, pair in enumerate(pairs):
        for phrasing in PHRASINGS:
            chunk = qa_chunk(codec, phrasing.format(q=pair.question), pair.answer)
            if len(chunk.tokens) > positions:
                raise InvalidArgument(
                    f"phrased and chat-templated, the pair is {len(chunk.tokens)} tokens; the "
                    f"base model has {positions} positions",
                    field=f"pairs[{i}]",
                )
            out.append(Unit(i, (chunk,)))
    return out


def shift_keep(positions: int, chunk_tokens: int) -> int:
    """How many of a document's tokens a shifted context keeps (see the module docstring):
    positions / 16, so that the tokens a shift computes again stay near 1/15 of those it
    trains while windows are short, and the window after a shift still reads some context
    (32 tokens on 512 positions); less when a window leaves no room for that."""
    return min(positions // 16, positions - chunk_tokens)


def check_chunk_tokens(chunk_tokens: int, positions: int) -> None:
    """A window must fit in the model's positions (with room for no context at all)."""
    if chunk_tokens > positions:
        raise InvalidArgument(
            f"{chunk_tokens} tokens per window exceed the base model's {positions} positions",
            field="chunk_tokens",
        )


def windows(tokens: Sequence[int], chunk_tokens: int, positions: int) -> tuple[Chunk, ...]:
    """A document's truncated-BPTT windows: `chunk_tokens` inputs each, predicting the next
    token at every position, each after its segment's earlier tokens as context, context
    and window together within `positions`."""
    check_chunk_tokens(chunk_tokens, positions)
    keep = shift_keep(positions, chunk_tokens)
    out = []
    segment = 0
    last = len(tokens) - 1  # the final token is only ever a target
    for start in range(0, last, chunk_tokens):
        end = min(start + chunk_tokens, last)
        if end - segment > positions:
            segment = start - keep
        out.append(
            Chunk(
                tuple(tokens[start:end]),
                tuple(tokens[start + 1 : end + 1]),
                (1,) * (end - start),
                tuple(tokens[segment:start]),
                window=True,
            )
        )
    return tuple(out)


def document_units(
    codec: Codec, documents: Sequence[str], chunk_tokens: int, positions: int
) -> list[Unit]:
    units = []
    for i, doc in enumerate(documents):
        tokens = codec.encode(doc)
        if len(tokens) < 2:
            raise InvalidArgument(
                "a document needs at least 2 tokens to train on", field=f"documents[{i}]"
            )
        units.append(Unit(i, windows(tokens, chunk_tokens, positions)))
    return units


def split(units: Sequence[Unit], fraction: float, seed: int) -> tuple[list[Unit], list[Unit]]:
    """A seeded split of whole groups: every unit of a held-out pair (all four phrasings)
    or document goes to validation together. `round(fraction × groups)`, at least one, and
    at least one group must stay for training."""
    groups = sorted({u.group for u in units})
    if fraction == 0:
        return list(units), []
    n_val = max(1, round(fraction * len(groups)))
    if n_val >= len(groups):
        raise InvalidArgument(
            f"holds out {n_val} of {len(groups)} pairs/documents, leaving none to train on",
            field="validation_split",
        )
    held = set(random.Random(f"{seed}:split").sample(groups, n_val))
    return [u for u in units if u.group not in held], [u for u in units if u.group in held]


def subsample(units: Sequence[Unit], budget: int, seed: int) -> tuple[list[Unit], int]:
    """Juno's `max_train_tokens`: when the units' input tokens exceed the budget, a seeded
    sample of whole chunks that fits it (0 = no budget). Returns (units, dropped chunks)."""
    flat = [(ui, ci) for ui, u in enumerate(units) for ci in range(len(u.chunks))]
    total = sum(len(units[ui].chunks[ci].tokens) for ui, ci in flat)
    if budget == 0 or total <= budget:
        return list(units), 0
    keep: set[tuple[int, int]] = set()
    used = 0
    for ui, ci in random.Random(f"{seed}:subsample").sample(flat, len(flat)):
        n = len(units[ui].chunks[ci].tokens)
        if used + n <= budget:
            keep.add((ui, ci))
            used += n
    if not keep:
        raise InvalidArgument(
            f"{budget} tokens cannot hold a single chunk", field="max_train_tokens"
        )
    out = []
    for ui, u in enumerate(units):
        chunks = tuple(c for ci, c in enumerate(u.chunks) if (ui, ci) in keep)
        if chunks:
            out.append(Unit(u.group, chunks))
    return out, len(flat) - len(keep)


def qa_plan(
    codec: Codec, pairs: Sequence[Pair], fraction: float, seed: int, budget: int, positions: int
) -> Plan:
    family = require_template(codec)
    units = qa_units(codec, pairs, positions)
    train, validation = split(units, fraction, seed)
    train, dropped = subsample(train, budget, seed)
    return Plan(tuple(train), tuple(validation), len(pairs), len(units), family, dropped)


def text_plan(
    codec: Codec,
    documents: Sequence[str],
    chunk_tokens: int,
    fraction: float,
    seed: int,
    budget: int,
    positions: int,
) -> Plan:
    check_chunk_tokens(chunk_tokens, positions)  # before the documents are tokenised
    units = document_units(codec, documents, chunk_tokens, positions)
    train, validation = split(units, fraction, seed)
    train, dropped = subsample(train, budget, seed)
    family = template_family(codec.chat_template) if codec.chat_template else ""
    return Plan(tuple(train), tuple(validation), len(documents), len(units), family, dropped)
