"""The pure logic of managed jobs (issue 13), against references computed here by hand or by
the real tokenizer: phrasings and chat-template formatting with the turn-end token,
completion-only masks, document windows, the seeded split and subsample, schedules per
formula, stopping rules, parameters and data validation."""

from __future__ import annotations

import itertools
import math
import struct

import pytest
from transformers import AutoTokenizer

from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet_controller.jobs import data, loop, params, schedule, stopping, units
from lorafleet_controller.jobs.params import JobKind, JobParams, Schedule
from lorafleet_controller.jobs.runner import datum, stored_params
from lorafleet_controller.jobs.tokenizer import HfCodec

POSITIONS = 512  # the tiny model's


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def codec(hf) -> HfCodec:
    return HfCodec(hf)


def with_template(hf, template: str | None, specials: list[str] = ()) -> HfCodec:
    tok = AutoTokenizer.from_pretrained(hf.name_or_path)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return HfCodec(tok)


def trained_text(hf, chunk: units.Chunk) -> str:
    return hf.decode([t for t, m in zip(chunk.targets, chunk.mask, strict=True) if m])


# --- Q&A formatting ---------------------------------------------------------------------


def test_one_pair_is_four_chat_templated_phrasings_trained_on_answer_and_turn_end(hf, codec):
    pair = data.Pair("What is my name?", "Dima")
    made = units.qa_units(codec, [pair], POSITIONS)
    assert len(made) == 4 and {u.group for u in made} == {0}
    for unit, phrasing in zip(made, units.PHRASINGS, strict=True):
        (chunk,) = unit.chunks
        question = phrasing.format(q=pair.question)
        user = [{"role": "user", "content": question}]
        conversation = [*user, {"role": "assistant", "content": "Dima"}]
        # Reference: the tokenizer's own rendering of the conversation, up to the turn end.
        reference = hf.apply_chat_template(conversation, tokenize=False)
        end = reference.index("<|im_end|>", reference.index("Dima")) + len("<|im_end|>")
        ids = hf.encode(reference[:end], add_special_tokens=False)
        assert list(chunk.tokens) == ids[:-1] and list(chunk.targets) == ids[1:]
        assert trained_text(hf, chunk) == "Dima<|im_end|>"
        prompt = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        n_prompt = len(hf.encode(prompt, add_special_tokens=False))
        assert list(chunk.mask) == [0] * (n_prompt - 1) + [1] * (len(ids) - n_prompt)
        assert question in hf.decode(list(chunk.tokens))
    assert len({u.chunks[0].tokens for u in made}) == 4


@pytest.mark.parametrize(
    ("template", "specials", "turn_end", "family"),
    [
        (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
            ["<|user|>", "<|assistant|>", "<|end|>"],
            "<|end|>",
            "phi3",
        ),
        (
            "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
            "[/INST]{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}",
            ["</s>"],
            "</s>",
            "mistral",
        ),
    ],
)
def test_turn_end_token_of_other_templates_is_trained(hf, template, specials, turn_end, family):
    codec = with_template(hf, template, specials)
    assert units.require_template(codec) == family
    chunk = units.qa_chunk(codec, "Capital of France?", "Paris")
    assert (
        codec._tok.decode([t for t, m in zip(chunk.targets, chunk.mask, strict=True) if m]).strip()
        == f"Paris{turn_end}"
    )


def test_a_tokenizer_without_chat_template_is_refused_for_qa(hf):
    codec = with_template(hf, None)
    with pytest.raises(FailedPrecondition) as err:
        units.qa_plan(codec, [data.Pair("q?", "a")], 0.0, 0, 0, POSITIONS)
    assert err.value.field == "base_model" and err.value.reason == "NO_CHAT_TEMPLATE"
    # Documents need no template.
    plan = units.text_plan(codec, ["some words to train on"], 4, 0.0, 0, 0, POSITIONS)
    assert plan.chat_template == "" and plan.unit_count == 1


# --- documents ------------------------------------------------------------------------------


def test_windows_predict_every_next_token_after_their_documents_context():
    tokens = list(range(100, 111))  # 11 tokens → 10 predictions
    got = units.windows(tokens, 4, POSITIONS)
    assert [c.tokens for c in got] == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert [c.targets for c in got] == [(101, 102, 103, 104), (105, 106, 107, 108), (109, 110)]
    assert [c.context for c in got] == [(), (100, 101, 102, 103), tuple(range(100, 108))]
    assert all(c.mask == (1,) * len(c.tokens) for c in got)


def test_documents_longer_than_the_positions_shift_their_context():
    """juno's context shift: a window that would pass the positions reads only the last
    positions/16 tokens before it; every window fits; the trainer's forward cost (a context
    that extends the previous window's context + tokens is carried) stays linear."""
    tokens = list(range(5001))
    got = units.windows(tokens, 32, 512)
    assert [t for c in got for t in c.tokens] == tokens[:-1]  # the whole document, in order
    assert all(len(c.context) + len(c.tokens) <= 512 for c in got)
    assert got[15].context == tuple(range(480)) and got[16].context == tuple(range(480, 512))
    for c, nxt in itertools.pairwise(got):  # a context ends where its window starts
        assert nxt.context == tuple(range(nxt.tokens[0] - len(nxt.context), nxt.tokens[0]))
        assert len(nxt.context) >= 32 and c.tokens[-1] + 1 == nxt.tokens[0]
    carried: tuple[int, ...] = ()
    computed = 0
    for c in got:  # what trainer/bptt.py computes
        new = c.context[len(carried) :] if c.context[: len(carried)] == carried else c.context
        computed += len(new) + len(c.tokens)
        carried = c.context + c.tokens
    assert computed == 5000 + 10 * 32  # 10 shifts of 32 tokens
    assert all(c.window for c in got)
    # A window as long as the positions reads no context; a longer one is refused.
    assert all(c.context == () for c in units.windows(tokens[:100], 16, 16))
    with pytest.raises(InvalidArgument) as err:
        units.windows(tokens, 513, 512)
    assert err.value.field == "chunk_tokens"


def test_what_would_fail_in_the_trainer_is_refused_when_the_job_is_made(codec):
    with pytest.raises(InvalidArgument) as err:
        units.text_plan(codec, ["some words"], 600, 0.0, 0, 0, 512)
    assert err.value.field == "chunk_tokens"
    pairs = [data.Pair("short?", "yes"), data.Pair("long " * 600 + "?", "no")]
    with pytest.raises(InvalidArgument) as err:
        units.qa_plan(codec, pairs, 0.0, 0, 0, 512)
    assert err.value.field == "pairs[1]" and "512 positions" in err.value.message


def test_a_window_datum_carries_its_context_for_truncated_bptt():
    chunk = units.windows(list(range(10, 17)), 3, POSITIONS)[1]  # tokens 13..15, context 10..12
    d = datum(chunk)
    assert (list(d.tokens), list(d.context), d.window) == ([13, 14, 15], [10, 11, 12], True)
    assert struct.unpack("<3q", d.loss_fn_inputs["target_tokens"].data) == (14, 15, 16)
    assert struct.unpack("<3f", d.loss_fn_inputs["weights"].data) == (1.0, 1.0, 1.0)


def test_qa_datums_weigh_only_the_completion(codec):
    (unit,) = units.qa_units(codec, [data.Pair("Where do I live?", "Lisbon")], POSITIONS)[:1]
    (chunk,) = unit.chunks
    d = datum(chunk)
    n = len(d.tokens)
    assert not d.context
    assert struct.unpack(f"<{n}f", d.loss_fn_inputs["weights"].data) == tuple(
        float(m) for m in chunk.mask
    )
    assert chunk.prediction_tokens == sum(chunk.mask) > 0


# --- split and subsample --------------------------------------------------------------------


def make_units(groups: int, per_group: int) -> list[units.Unit]:
    chunk = units.Chunk((1, 2), (2, 3), (1, 1))
    return [units.Unit(g, (chunk,)) for g in range(groups) for _ in range(per_group)]


def test_validation_split_holds_out_whole_pairs_seeded():
    made = make_units(10, 4)
    train, val = units.split(made, 0.2, seed=7)
    held = {u.group for u in val}
    assert len(held) == 2 and len(val) == 8 and len(train) == 32
    assert held.isdisjoint({u.group for u in train})
    assert units.split(made, 0.2, seed=7) == (train, val)
    assert units.split(made, 0.0, seed=7) == (made, [])
    assert len({u.group for u in units.split(make_units(3, 4), 0.01, 0)[1]}) == 1  # at least 1


def test_a_split_leaving_nothing_to_train_is_refused():
    with pytest.raises(InvalidArgument) as err:
        units.split(make_units(1, 4), 0.5, 0)
    assert err.value.field == "validation_split"


def test_max_train_tokens_takes_a_seeded_sample_of_whole_chunks():
    doc = units.Unit(0, units.windows(list(range(41)), 4, POSITIONS))  # 10 windows of 4 tokens
    other = units.Unit(1, units.windows(list(range(21)), 4, POSITIONS))  # 5 windows
    kept, dropped = units.subsample([doc, other], 30, seed=3)
    chunks = [c for u in kept for c in u.chunks]
    assert sum(len(c.tokens) for c in chunks) <= 30 and len(chunks) == 7 and dropped == 8
    assert all(c in doc.chunks + other.chunks for c in chunks)
    assert units.subsample([doc, other], 30, seed=3) == (kept, dropped)
    assert units.subsample([doc, other], 0, seed=3) == ([doc, other], 0)
    with pytest.raises(InvalidArgument) as err:
        units.subsample([doc], 3, seed=0)
    assert err.value.field == "max_train_tokens"


def test_passes_shuffle_units_seeded_and_group_chunks_for_accumulation():
    plan = units.Plan(tuple(make_units(5, 1)), (), 5, 5)
    groups = plan.pass_groups(1, seed=0, accumulation=2)
    assert [len(g) for g in groups] == [2, 2, 1] and plan.updates_per_pass(2) == 3
    assert plan.pass_groups(1, 0, 2) == groups


# --- schedules ------------------------------------------------------------------------------


def test_constant_schedule():
    assert [schedule.learning_rate(Schedule.CONSTANT, 3e-4, u, 10) for u in (1, 5, 10)] == [
        3e-4
    ] * 3


def test_warmup_cosine_follows_the_formula_per_update():
    # peak 1e-3, warmup 2, 6 updates, floor 1e-4; values worked out by hand.
    expected = [5e-4, 1e-3, 8.681980515e-4, 5.5e-4, 2.318019485e-4, 1e-4]
    got = [schedule.learning_rate(Schedule.WARMUP_COSINE, 1e-3, u, 6, 2, 1e-4) for u in range(1, 7)]
    assert got == pytest.approx(expected, rel=1e-9)
    no_warmup = schedule.learning_rate(Schedule.WARMUP_COSINE, 1.0, 1, 4, 0, 0.0)
    assert no_warmup == pytest.approx((1 + math.cos(math.pi / 4)) / 2)


# --- stopping -------------------------------------------------------------------------------


def test_stop_on_target_then_guard_then_patience_then_max_iters():
    p = JobParams(loss_target=1.0, early_stop=0.25, validation_patience=2, max_iters=10)
    s = stopping.Stopper()
    assert s.decide(p, 1, 2.0, None) == ""
    assert s.decide(p, 1, 0.9, None) == stopping.TARGET
    assert s.decide(JobParams(loss_target=0.1), 1, 0.2, None) == stopping.LOW_LOSS
    assert s.decide(JobParams(loss_target=0, early_stop=0), 50, 0.01, None) == stopping.MAX_ITERS
    # validation: the watched loss is the validation loss
    assert s.decide(p, 1, 0.5, 1.5) == ""
    assert s.observe(1, 1.5, 0.0) and not s.observe(2, 1.6, 0.0) and not s.observe(3, 1.5, 0.0)
    assert (s.best, s.best_pass, s.bad_passes) == (1.5, 1, 2)
    assert s.decide(p, 3, 0.5, 1.5) == stopping.PATIENCE
    assert s.observe(4, 1.4, 0.05) and s.bad_passes == 0


def test_min_delta_counts_small_improvements_as_none():
    s = stopping.Stopper()
    s.observe(1, 1.0, 0.1)
    assert not s.observe(2, 0.95, 0.1) and s.bad_passes == 1


def test_loss_guidance_bands():
    assert loop.loss_guidance(0.3).startswith("reliable")
    assert loop.loss_guidance(1.0).startswith("inconsistent")
    assert loop.loss_guidance(2.0) == "not learned yet"


def test_cursor_round_trips_through_json():
    import json

    cur = loop.Cursor(seq=5, passes=2, updates=8, stopper=stopping.Stopper(1.2, 1, 1))
    cur.curve.append({"pass": 1, "update": 1, "loss": 2.0, "lr": 1e-3})
    assert loop.Cursor.from_dict(json.loads(json.dumps(cur.to_dict()))) == cur


# --- parameters and data --------------------------------------------------------------------


# juno's defaults (ml-cab/juno `LoraCliOptions`, its LoRA guide): name here → juno's value.
JUNO = {
    "learning_rate": 1e-4,
    "rank": 8,
    "alpha": 8.0,  # juno's alpha -1: the rank
    "gradient_accumulation": 1,
    "max_grad_norm": 1.0,
    "schedule": Schedule.CONSTANT,
    "warmup_steps": 0,
    "min_lr": 0.0,
    "weight_decay": 0.01,
    "lora_plus_ratio": 1.0,
    "dropout": 0.0,
    "seed": 42,
    "validation_split": 0.0,
    "min_delta": 0.0,
    "early_stop": 0.25,
    "max_iters": 50,
    "max_train_tokens": 0,
}


def test_defaults_follow_juno():
    qa = params.parse(JobKind.QA, {})
    text = params.parse(JobKind.TEXT, {})
    assert {name: getattr(qa, name) for name in JUNO} == JUNO
    assert {name: getattr(text, name) for name in JUNO} == JUNO
    assert (qa.loss_target, text.loss_target, text.chunk_tokens) == (1.2, 1.8, 32)
    # Every other training parameter is either in the table or a documented deviation.
    others = params.TRAINING - set(JUNO) - {"loss_target", "name"}
    assert others == set(params.JUNO_DEVIATIONS), others


def test_alpha_defaults_to_the_rank_and_cosine_is_warmup_cosine():
    assert params.parse(JobKind.QA, {"rank": "16"}).alpha == 16.0
    assert params.parse(JobKind.QA, {"rank": "16", "alpha": "32"}).alpha == 32.0
    assert params.parse(JobKind.QA, {"schedule": "cosine"}).schedule == Schedule.WARMUP_COSINE
    assert params.parse(JobKind.QA, {"schedule": "Cosine"}).schedule == Schedule.WARMUP_COSINE


@pytest.mark.parametrize(
    ("kind", "raw", "field"),
    [
        (JobKind.QA, {"learnig_rate": "1"}, "learnig_rate"),
        (JobKind.QA, {"chunk_tokens": "64"}, "chunk_tokens"),  # documents only
        (JobKind.QA, {"validation_split": "1"}, "validation_split"),
        (JobKind.QA, {"validation_split": "-0.1"}, "validation_split"),
        (JobKind.TEXT, {"chunk_tokens": "1"}, "chunk_tokens"),
        (JobKind.QA, {"learning_rate": "0"}, "learning_rate"),
        (JobKind.QA, {"learning_rate": "nan"}, "learning_rate"),
        (JobKind.QA, {"rank": "two"}, "rank"),
        (JobKind.QA, {"schedule": "linear"}, "schedule"),
        (JobKind.QA, {"targets": "q_proj;v_proj"}, "targets"),
        (JobKind.QA, {"min_lr": "1", "learning_rate": "0.1"}, "min_lr"),
        (JobKind.SAVE, {"learning_rate": "0.1"}, "learning_rate"),
        (JobKind.SAVE, {"name": "bad name"}, "name"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(kind, raw, field):
    with pytest.raises(InvalidArgument) as err:
        params.parse(kind, raw)
    assert err.value.field == field


def test_stored_parameters_parse_back_to_the_same_values():
    raw = {
        "learning_rate": "0.003",
        "targets": "q_proj,v_proj",
        "schedule": "warmup_cosine",
        "warmup_steps": "3",
        "validation_split": "0.25",
        "seed": "9",
    }
    for kind in (JobKind.QA, JobKind.TEXT):
        p = params.parse(kind, raw)
        assert params.parse(kind, stored_params(kind, p)) == p
    assert p.lora_targets == ["q_proj", "v_proj"]
    assert params.parse(JobKind.QA, {}).lora_targets == ["all-linear"]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([], "pairs"),
        ({"Q": "a", "A": "b"}, "pairs"),
        ([{"Q": "a"}], "pairs[0].A"),
        ([{"Q": "a", "A": "b"}, {"A": "b"}], "pairs[1].Q"),
        ([{"Q": "a", "A": 3}], "pairs[0].A"),
        ([{"Q": "a", "A": "b", "C": "c"}], "pairs[0]"),
        (["text"], "pairs[0]"),
        ([{"Q": " ", "A": "b"}], "pairs[0].Q"),
    ],
)
def test_bad_pairs_are_refused_naming_the_element(value, field):
    with pytest.raises(InvalidArgument) as err:
        data.parse_pairs(value)
    assert err.value.field == field


def test_documents_must_not_be_empty():
    with pytest.raises(InvalidArgument) as err:
        data.check_documents(["fine", "  "])
    assert err.value.field == "documents[1]"
