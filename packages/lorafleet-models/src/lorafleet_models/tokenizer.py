"""Byte-level BPE tokenizer trained on the shipped corpus, with a ChatML chat template.

Recipe from platform.md §2.1. The special-token strings are removed from the training text so
merges are learnt on words only; the tokens themselves are added as whole special tokens and
the corpus dialogues tokenise them as single ids. Training is deterministic for a given text.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lorafleet_models.corpus import corpus_documents

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END)

# ChatML, as Qwen-style tokenizers do; the corpus renders its dialogues the same way
# (corpus_gen.chat), which is what makes the pre-trained model fluent in this format.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(corpus_text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train the BPE on the corpus documents and wrap it as a transformers tokenizer."""
    training_docs = [_strip_specials(doc) for doc in corpus_documents(corpus_text)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_docs, trainer=trainer, length=len(training_docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path, max_length: int) -> None:
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(out_dir)


def _strip_specials(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text
