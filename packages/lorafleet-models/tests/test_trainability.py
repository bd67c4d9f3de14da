"""The pre-trained tiny model learns a new fact with LoRA in tens of steps; a random one cannot.

This is the property the rest of the fleet relies on when it trains adapters on the tiny model
in tests: "What is my name?" → "Dima" (a name the corpus never contains), four phrasings,
completion-only loss, PEFT LoRA r=8 on all linear layers, AdamW.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

QUESTIONS = ("What is my name?", "What's my name?", "Do you know my name?", "Tell me my name.")
ANSWER = "Dima"
STEPS = 40
LR = 3e-3


def chat_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + answer rows, right-padded; labels only on the answer and its <|im_end|>."""
    rows, labels = [], []
    answer = tokenizer(ANSWER + "<|im_end|>", add_special_tokens=False)["input_ids"]
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, lab, mask


def train_lora(model, batch) -> tuple[object, float]:
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    ids, labels, mask = batch
    for _ in range(STEPS):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    with torch.no_grad():
        final = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    return peft_model, final


def greedy_answer(model, tokenizer, question: str) -> str:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_lora_learns_a_new_fact_quickly(tiny_model_dir: Path, tokenizer) -> None:
    batch = chat_batch(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(ANSWER not in greedy_answer(base, tokenizer, q) for q in QUESTIONS)
    with torch.no_grad():
        before = base(input_ids=batch[0], attention_mask=batch[2], labels=batch[1]).loss.item()

    tuned, pretrained_loss = train_lora(base, batch)
    answers = [greedy_answer(tuned, tokenizer, q) for q in QUESTIONS]

    torch.manual_seed(1)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    _, random_loss = train_lora(AutoModelForCausalLM.from_config(config), batch)

    print(
        f"\nLoRA {STEPS} steps: pre-trained {before:.3f} -> {pretrained_loss:.3f}; "
        f"random-init -> {random_loss:.3f}; answers {answers}"
    )
    assert pretrained_loss < 0.15
    assert all(a.strip() == ANSWER for a in answers), answers
    assert random_loss > 10 * pretrained_loss
