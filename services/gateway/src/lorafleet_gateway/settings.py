"""Gateway settings, from `LORAFLEET_GATEWAY_*` environment variables.

The gateway is stateless: everything here is about reaching the controller and shaping the
HTTP surface. The download secret signs the short-lived URLs of checkpoint downloads: every
replica must use the same one, and it must outlive restarts, so it comes from a setting (a
Kubernetes Secret) or from a key file that the first gateway on a machine creates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lorafleet import contract
from lorafleet.errors import InvalidArgument
from lorafleet.settings import SettingsError, setting

ENV_PREFIX = "LORAFLEET_GATEWAY_"


@dataclass(frozen=True)
class GatewaySettings:
    host: str = setting("127.0.0.1", doc="Interface to listen on (0.0.0.0 in a cluster).")
    port: int = setting(
        8000, doc="HTTP port (the Tinker base URL; it serves no /metrics).", min=0, max=65535
    )
    metrics_port: int = setting(
        0,
        doc="Prometheus /metrics port, for operators only; 0 disables the endpoint.",
        min=0,
        max=65535,
    )
    controller_address: str = setting(
        "127.0.0.1:50051", doc="host:port of the controller's gRPC endpoint."
    )
    long_poll_seconds: float = setting(
        20.0,
        doc="How long retrieve_future waits for a result before answering try_again "
        "(the SDK's read timeout is 45 s).",
        min=0.0,
        max=40.0,
    )
    max_body_bytes: int = setting(
        64 * 1024 * 1024,
        doc="Largest body of a data route (forward_backward, forward, asample), before and "
        "after zstd decompression (413 above).",
        min=1024,
        max=1024 * 1024 * 1024,
    )
    max_rows_per_operation: int = setting(
        4096,
        doc="Data rows one forward or forward_backward may carry (400 naming `data` above, "
        "before it is admitted), so one step's work and memory on a trainer stay bounded "
        "whatever fits in a body. 4096 is far above the batches SDK recipes send (32 to 1024 "
        "rows); 0 = no cap.",
        min=0,
        max=1 << 30,
    )
    max_tokens_per_operation: int = setting(
        1 << 20,
        doc="Tokens one forward or forward_backward may carry over all its rows, context "
        "included (400 naming `data` above). 1,048,576 is about what the controller's 16 MiB "
        "payload cap holds with int64 targets and float weights; 0 = no cap.",
        min=0,
        max=1 << 40,
    )
    max_small_body_bytes: int = setting(
        1024 * 1024,
        doc="Largest body of every other route (sessions, telemetry, saves, futures; 413 "
        "above, refused from Content-Length before anything is read).",
        min=1024,
        max=64 * 1024 * 1024,
    )
    rpc_timeout_seconds: float = setting(
        10.0, doc="Deadline of short controller calls (submits, lookups).", min=0.5, max=120.0
    )
    auth_cache_seconds: float = setting(
        1.0,
        doc="How long a successful API-key check is reused (0 = ask every time); a revoked "
        "key stops working within this time, so it is at most 1 s.",
        min=0.0,
        max=1.0,
    )
    proto_flags: bool = setting(
        True,
        doc="Offer the recommended client/config flags (proto_write_fwdbwd, fwd_via_fwdbwd, "
        "create_model_via_load_weights) so 0.24.1 uses 0.38's wire paths; false serves {} "
        "(0.24.1 then speaks JSON).",
    )
    compress_fwdbwd: bool = setting(
        False, doc="Ask clients to zstd-compress forward_backward bodies (proto_compress_fwdbwd)."
    )
    ack_results: bool = setting(
        True,
        doc="Acknowledge an operation once its result was sent: the ledger releases it the "
        "controller's acked_result_grace_seconds later (a poll after that answers 410).",
    )
    download_secret: str = setting(
        "",
        doc="HMAC key for signed download URLs, the same on every replica (from a Secret; at "
        "least 16 characters); empty = read download_secret_file.",
    )
    download_secret_file: str = setting(
        "~/.lorafleet/gateway-download-secret",
        doc="File holding the download HMAC key when download_secret is empty; created "
        "(mode 0600, random key) by the first gateway that finds it missing, so URLs survive "
        "restarts and agree between the replicas of one machine.",
    )
    download_ttl_seconds: int = setting(
        900, doc="Lifetime of a signed download URL.", min=10, max=7 * 24 * 3600
    )
    public_url: str = setting(
        "",
        doc="Base URL clients reach the gateway at, for download links; empty = the "
        "request's own base URL.",
    )
    log_level: str = setting(
        "INFO", doc="Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    lora_defaults: str = setting(
        "",
        doc="Server-wide defaults of the LoRA options a run may set with user_metadata "
        "lorafleet.* keys, as 'name=value' pairs separated by ';' (for example "
        "'alpha=16;target_modules=q_proj,v_proj'); empty = the contract's defaults.",
    )

    def __post_init__(self) -> None:
        try:
            self.lora_option_defaults  # noqa: B018  # parse now: a bad value fails at start-up
        except InvalidArgument as exc:
            raise SettingsError(
                f"{ENV_PREFIX}LORA_DEFAULTS={self.lora_defaults!r}: {exc}"
            ) from None

    @cached_property
    def lora_option_defaults(self) -> contract.LoraOptions:
        """`lora_defaults` as the LoRA options a run gets when it names none."""
        pairs = [p.partition("=") for p in self.lora_defaults.split(";") if p.strip()]
        metadata = {f"{contract.METADATA_PREFIX}{k.strip()}": v.strip() for k, _, v in pairs}
        return contract.split_lora_options(metadata)[0]
