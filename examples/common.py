"""What every example needs from the SDK, for both tinker 0.24.1 and 0.38.x."""

from __future__ import annotations

import os

import tinker

NEW_SDK = not tinker.__version__.startswith("0.24")


def done(x):
    """0.38's create_* return futures; 0.24.1's return the object itself."""
    return x.result() if NEW_SDK and hasattr(x, "result") else x


def base_model(sc: tinker.ServiceClient, requested: str = "") -> str:
    """The requested base model, else LORAFLEET_BASE_MODEL, else the first one served."""
    requested = requested or os.environ.get("LORAFLEET_BASE_MODEL", "")
    if requested:
        return requested
    caps = (
        tinker.RestClient().get_server_capabilities() if NEW_SDK else sc.get_server_capabilities()
    )
    return done(caps).supported_models[0].model_name


def chat_tokens(tok, user: str, assistant: str | None = None) -> list[int]:
    """Chat-templated tokens: the prompt (with generation prompt), or the whole exchange.

    Rendered to text first, then encoded: `apply_chat_template(tokenize=True)` returns a
    list in some transformers versions and a dict in others."""
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    text = tok.apply_chat_template(
        messages, add_generation_prompt=assistant is None, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


def completion_datum(tok, question: str, answer: str) -> tinker.types.Datum:
    """A chat exchange where only the answer's tokens carry loss (weight 1, prompt 0)."""
    prompt, full = chat_tokens(tok, question), chat_tokens(tok, question, answer)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def ask(sampler, tok, question: str, max_tokens: int) -> str:
    """The greedy answer of `sampler` to a chat-templated question."""
    prompt = tinker.types.ModelInput.from_ints(chat_tokens(tok, question))
    params = tinker.types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    out = sampler.sample(prompt, 1, params).result()
    return tok.decode(out.sequences[0].tokens, skip_special_tokens=True).strip()
