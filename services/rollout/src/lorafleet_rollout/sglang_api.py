"""The SGLang HTTP schema our driver uses: request and response bodies, in one reviewable place.

Read from sglang 0.5.23 (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`:
GenerateReqInput, LoadLoRAAdapterReqInput, UnLoadLoRAAdapterReqInput, LoRAUpdateOutput) and
design-lessons.md §10.2. Only the fields we send or read are modelled; requests forbid extra
fields so the fake server in the tests rejects a misspelt one exactly as a schema change would
surface. Bump SGLANG_VERSION together with a re-read of those files.

Hazards encoded here: `lora_path` is the *name* of a loaded adapter (a string, or one entry
per prompt with None = base), and a /generate without it silently runs on the base model, so
the driver always sets it explicitly (design-lessons §10.3).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

SGLANG_VERSION = "0.5.23"

LOAD_LORA = "/load_lora_adapter"
UNLOAD_LORA = "/unload_lora_adapter"
GENERATE = "/generate"
HEALTH = "/health"
MODEL_INFO = "/model_info"
SERVER_INFO = "/server_info"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadLoraAdapter(_Request):
    lora_name: str
    #: A PEFT folder the *server* can read.
    lora_path: str
    pinned: bool = False


class UnloadLoraAdapter(_Request):
    lora_name: str


class LoraUpdateResult(BaseModel):
    """Body of both adapter routes: 200 on success, 400 with success=false otherwise."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


class SamplingParams(_Request):
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = False
    no_stop_trim: bool = True


class GenerateRequest(_Request):
    """One prompt (input_ids: list[int]) or a batch (list[list[int]])."""

    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParams | list[SamplingParams]
    #: Adapter *name*; one per prompt for a batch; None = base model.
    lora_path: str | list[str | None] | None
    return_logprob: bool = True
    #: Prompt position from which input logprobs are returned; -1 = outputs only.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


#: (logprob, token_id, text-or-None); the first prompt position has logprob None.
LogprobEntry = tuple[float | None, int, str | None]


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    output_token_logprobs: list[LogprobEntry] = []
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResult(BaseModel):
    """One sequence; a batch (or n > 1) answers with a list of these, prompt-major."""

    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo
