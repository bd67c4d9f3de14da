"""The SGLang HTTP schema our driver uses: request and response bodies, in one reviewable place.

Read from sglang 0.5.23 (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`:
GenerateReqInput, LoadLoRAAdapterReqInput, UnLoadLoRAAdapterReqInput, LoRAUpdateOutput, AbortReq;
`srt/managers/tokenizer_manager.py` for error and abort bodies and batch streaming;
`srt/managers/schedule_batch.py` FINISH_* for finish reasons; `srt/server_args.py` for
/server_info) and design-lessons.md §10.2. Only the fields we send or read are modelled;
requests forbid extra fields so the fake server in the tests rejects a misspelt one exactly as
a schema change would surface. Bump SGLANG_VERSION together with a re-read of those files.

Hazards encoded here: `lora_path` is the *name* of a loaded adapter (a string, or one entry
per prompt with None = base), and a /generate without it silently runs on the base model, so
the driver always sets it explicitly (design-lessons §10.3). A /generate naming an adapter that
was unloaded silently re-loads it from the path it was first loaded from
(`TokenizerManager._resolve_lora_path`, which never forgets a name), so the driver publishes
every load under a fresh name from a folder it deletes on unload (`sglang_engine.py`).
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
#: OpenAI model list: the base model and one card per registered adapter (id = lora_name).
MODELS = "/v1/models"
ABORT = "/abort_request"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadLoraAdapter(_Request):
    lora_name: str
    #: A PEFT folder the *server* can read.
    lora_path: str
    pinned: bool = False


class UnloadLoraAdapter(_Request):
    lora_name: str


class AbortRequest(_Request):
    rid: str = ""
    abort_all: bool = False


class LoraUpdateResult(BaseModel):
    """Body of both adapter routes: 200 on success, 400 with success=false otherwise."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


class ErrorBody(BaseModel):
    """/generate's refusal (`http_server._create_error_response`): 400 {"error": {"message"}}.

    An unknown adapter name is one: "Got LoRA adapter that has never been loaded: NAME ..."
    (`tokenizer_manager._resolve_lora_path`).
    """

    class Error(BaseModel):
        message: str

    error: Error


#: The message prefix SGLang answers for an adapter name it has no record of (a restarted
#: server has none).
NEVER_LOADED = "Got LoRA adapter that has never been loaded"


class ServerInfo(BaseModel):
    """The parts of /server_info (the resolved server arguments, flattened) we check."""

    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    #: --max-loaded-loras: past it SGLang silently unloads its own least recently used
    #: adapter (tokenizer_control_mixin), so the driver evicts before it gets there.
    max_loaded_loras: int | None = None
    #: Names as given to --lora-target-modules ("all" = every module SGLang supports).
    lora_target_modules: list[str] | None = None
    enable_deterministic_inference: bool = False
    version: str = ""


class ModelCard(BaseModel):
    id: str
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    data: list[ModelCard]


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
    """FINISH_MATCHED_TOKEN/STR ("stop"), FINISH_LENGTH, FINISH_ABORT (`schedule_batch.py`)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason | None
    #: Absent from an aborted request's answer (`tokenizer_manager` abort handling).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list[LogprobEntry] = []
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    #: With top_logprobs_num > 0: the best tokens at every output position.
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResult(BaseModel):
    """One sequence; a batch (or n > 1) answers with a list of these, prompt-major.

    A streamed batch interleaves its sequences' frames, each tagged with `index`, its position
    in that list (`TokenizerManager._stream_batch_responses`); every frame is a cumulative
    snapshot of its sequence (the default, non-incremental streaming output).
    """

    text: str = ""
    output_ids: list[int] = []
    meta_info: MetaInfo
    index: int | None = None
