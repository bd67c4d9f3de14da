"""The committed corpus is the generator's output, sized and formatted as the model needs."""

from __future__ import annotations

from lorafleet_models.corpus import CORPUS_PATH, corpus_documents, read_corpus
from lorafleet_models.corpus_gen import chat, generate_corpus
from lorafleet_models.tokenizer import CHAT_TEMPLATE, train_tokenizer


def test_committed_corpus_matches_generator() -> None:
    assert read_corpus() == generate_corpus(), "run `python -m lorafleet_models.corpus_gen`"


def test_corpus_size_and_content() -> None:
    text = read_corpus()
    assert 150_000 <= CORPUS_PATH.stat().st_size <= 400_000
    assert "dima" not in text.lower()
    docs = corpus_documents(text)
    dialogues = [d for d in docs if d.startswith("<|im_start|>")]
    assert len(docs) == 2500
    assert len(dialogues) > len(docs) // 2
    assert any("+" in d and "=" in d for d in docs)
    assert sum("What is my name?" in d for d in dialogues) > 20


def test_dialogues_use_the_tokenizer_chat_template() -> None:
    messages = [("system", "The user is called Tamo."), ("user", "Hi!"), ("assistant", "Hello!")]
    tokenizer = train_tokenizer("hello world<|endoftext|>\n", vocab_size=300)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False
    )
    assert rendered == chat(messages)
