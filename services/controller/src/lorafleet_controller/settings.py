"""ControllerSettings: everything the controller reads from `LORAFLEET_CONTROLLER_*`.

Every limit that shapes the ledger's semantics (gap sealing, claimed TTL, result TTL,
backpressure) is a setting here, so tests can shrink them to milliseconds and operators can
see them in `python -m lorafleet_controller --help`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.settings import setting

PREFIX = "LORAFLEET_CONTROLLER_"


@dataclass(frozen=True)
class ControllerSettings:
    redis_url: str = setting("redis://127.0.0.1:6379/0", doc="Redis holding all durable state.")
    redis_cluster: bool = setting(
        False,
        doc="REDIS_URL names a node of a Redis Cluster (LEDGER_GROUPS spreads the fleet's "
        "ledger over its masters).",
    )
    key_prefix: str = setting(
        "lf:",
        doc="Prefix of every Redis key (several fleets may share one Redis); it becomes the "
        "keys' hash tag, so letters, digits and _.:- only.",
    )
    ledger_groups: int = setting(
        1,
        doc="Groups the fleet's registrations are spread over (store/keys.py): a registration's "
        "records and the ledger's indexes live under its group's hash tag, so on a Redis "
        "Cluster the groups spread over the masters and the ledger's throughput with them "
        "(store/README.md). Fixed when a fleet first starts. 1 keeps the fleet on one slot "
        "(the layout before groups); on a Cluster use at least 8 per master.",
        min=1,
        max=16384,
    )
    storage_root: Path = setting(
        Path(".cache/controller-storage"),
        doc="Folder for sampler checkpoints (PEFT files the controller received on publish).",
    )
    shared_adapter_root: Path | None = setting(
        None,
        doc="Absolute folder the trainers and rollouts mount at the same path: a publish asks "
        "the trainer to write the adapter there and hands rollouts its URIs and SHA-256s, so "
        "no adapter bytes pass through the controller. Unset = the streamed push.",
    )
    store_full_fraction: float = setting(
        0.9,
        doc="New work (operations, samples, sessions, runs, jobs) is refused with a retryable "
        "429 once Redis's used_memory reaches this fraction of its maxmemory, so the writes "
        "that free room (acknowledgements, completions, deletes) never meet a full server "
        "(store/room.py). Redis must run with maxmemory-policy noeviction.",
        min=0.1,
        max=1.0,
    )
    store_room_check_seconds: float = setting(
        1.0,
        doc="How old the reading of Redis's memory (INFO memory) may be when work is admitted.",
        min=0.01,
        max=60.0,
    )
    gap_timeout_seconds: float = setting(
        600.0,
        doc="A missing seq_id is sealed after this long; operations behind it fail naming it.",
        min=0.01,
        max=86400.0,
    )
    claimed_timeout_seconds: float = setting(
        1800.0,
        doc="A CLAIMED operation with no result after this long is failed (server).",
        min=0.05,
        max=86400.0,
    )
    result_ttl_seconds: float = setting(
        3600.0,
        doc="Terminal results are kept this long unless acknowledged, then answered EXPIRED.",
        min=0.05,
        max=30 * 86400.0,
    )
    finished_session_retention_seconds: float = setting(
        7 * 86400.0,
        doc="A finished session's record (GetSession, ListSessions) and its samplers are "
        "forgotten this long after it finished; its runs and checkpoints stay. 0 = kept forever.",
        min=0.0,
        max=3650 * 86400.0,
    )
    retired_run_retention_seconds: float = setting(
        30 * 86400.0,
        doc="A retired (deleted) run's record is forgotten this long after it retired, once no "
        "checkpoint of it is left; its newest published version goes with it. 0 = kept forever.",
        min=0.0,
        max=3650 * 86400.0,
    )
    max_stored_bytes_per_tenant: int = setting(
        256 << 30,
        doc="A tenant whose checkpoints hold this many bytes has further named saves refused "
        "(400 STORAGE_QUOTA, storage_quota.py) until it deletes some; 0 = no cap.",
        min=0,
        max=1 << 60,
    )
    checkpoint_reclaim_grace_seconds: float = setting(
        600.0,
        doc="A deleted or expired checkpoint's files leave the disk this long after its record "
        "(reclaim.py), so operations dispatched before the removal finish reading them; files "
        "a run's replay may still load stay until its next snapshot. A published version "
        "nothing holds any more is collected this long after it was let go (version_gc.py).",
        min=0.0,
        max=30 * 86400.0,
    )
    acked_result_grace_seconds: float = setting(
        300.0,
        doc="An acknowledged result stays readable this long (until the sweep after it), "
        "no longer counting toward the unacked limits: a client whose answer was lost in "
        "transit (its read timed out on a loaded link) polls again and still gets it. Longer "
        "than the SDK's 45 s read timeout and its retries.",
        min=0.0,
        max=86400.0,
    )
    max_pending_per_registration: int = setting(
        256, doc="Open operations per registration (also the seq_id window).", min=1, max=100_000
    )
    max_unacked_results: int = setting(
        65536,
        doc="Terminal, unacknowledged results across every tenant: the ceiling that protects "
        "Redis's memory.",
        min=1,
        max=10_000_000,
    )
    max_unacked_results_per_tenant: int = setting(
        4096,
        doc="Terminal, unacknowledged results of one tenant: a tenant that never retrieves its "
        "results is refused, not everyone.",
        min=1,
        max=10_000_000,
    )
    max_unacked_bytes_per_tenant: int = setting(
        256 << 20,
        doc="Bytes of one tenant's terminal, unacknowledged results (bodies and errors), "
        "which Redis keeps up to RESULT_TTL_SECONDS: a tenant that never retrieves large "
        "results (forward logprobs of long sequences) is refused with backpressure once they "
        "hold this much. A result's size is known only when it finishes, which is never "
        "refused, so the use can pass this by what was open. 256 MiB, as "
        "MAX_PENDING_BYTES_PER_TENANT.",
        min=1024,
        max=1 << 40,
    )
    max_unacked_bytes_global: int = setting(
        512 << 20,
        doc="Bytes of the fleet's terminal, unacknowledged results (the fleet's ceiling); "
        "512 MiB, see MAX_PENDING_BYTES_GLOBAL.",
        min=1024,
        max=1 << 40,
    )
    max_pending_global: int = setting(
        65536,
        doc="Open operations across every tenant (the fleet's ceiling).",
        min=1,
        max=10_000_000,
    )
    max_pending_per_tenant: int = setting(
        4096, doc="Open operations of one tenant.", min=1, max=10_000_000
    )
    max_pending_bytes_per_tenant: int = setting(
        256 << 20,
        doc="Payload bytes of one tenant's open operations (admitted, not finished), which "
        "Redis holds until they run: a tenant queueing large forward_backward batches is "
        "refused with backpressure once they hold this much, however few they are. 256 MiB "
        "is 16 operations of the default MAX_PAYLOAD_BYTES (16 MiB), far more than a "
        "client stepping a few runs keeps open; one operation larger than this is refused as "
        "invalid, since no wait would admit it.",
        min=1024,
        max=1 << 40,
    )
    max_pending_bytes_global: int = setting(
        512 << 20,
        doc="Payload bytes of the fleet's open operations (the fleet's ceiling). 512 MiB, "
        "with MAX_UNACKED_BYTES_GLOBAL, is half of the chart's 2 GB Redis maxmemory, leaving "
        "the rest to acknowledged results in their grace, the records and Redis itself; raise "
        "both with the Redis's memory.",
        min=1024,
        max=1 << 40,
    )
    admission_rate_per_tenant: float = setting(
        200.0,
        doc="Training operations one tenant may submit per second, sustained (a token bucket in "
        "the admission script): a tenant flooding the ledger is refused with backpressure "
        "(retry after its next token) before its operations reach the ready queues, so it "
        "cannot slow another tenant's steps. 200/s is far above what SDK clients stepping a "
        "GPU submit (two operations a step) and caps one tenant at about a sixth of what the "
        "bench dispatcher can run (bench/fairness.py). Sampling is not counted. 0 = no limit.",
        min=0.0,
        max=1_000_000.0,
    )
    admission_burst_per_tenant: int = setting(
        400,
        doc="The bucket's depth: operations a tenant idle long enough may submit at once before "
        "ADMISSION_RATE_PER_TENANT applies (one full pipeline of a few runs).",
        min=1,
        max=10_000_000,
    )
    max_registrations_per_tenant: int = setting(
        1024, doc="Live (not retired) registrations of one tenant.", min=1, max=1_000_000
    )
    pipeline_submits: bool = setting(
        True,
        doc="Send SubmitOperation calls that arrive together to Redis as one pipeline (each "
        "admission still one atomic script); off = one round trip per call.",
    )
    max_batch_operations: int = setting(
        0,
        doc="At most this many forward/forward_backward operations in one trainer pass (0: "
        "no limit beyond the per-tenant shares). 1 runs every operation alone, so a run's "
        "results do not depend on who else trains beside it (a shared pass's padded width "
        "and row count change the last bits on some BLAS paths), at the cost of the batching "
        "speed-up: for bit-identical reruns of co-tenant runs.",
        min=0,
        max=1_000_000,
    )
    coalesce_window_ms: float = setting(
        2.0,
        doc="How long the scheduler waits for more forward_backward ops to batch together.",
        min=0.0,
        max=10_000.0,
    )
    heartbeat_timeout_seconds: float = setting(
        15.0,
        doc="A replica silent for this long is lost; its registrations become UNAVAILABLE.",
        min=0.1,
        max=3600.0,
    )
    heartbeat_interval_seconds: float = setting(
        5.0, doc="Heartbeat interval the controller asks replicas for.", min=0.05, max=600.0
    )
    session_timeout_seconds: float = setting(
        120.0,
        doc="A session with no heartbeat for this long is finished and its trainer slots freed. "
        "The SDKs heartbeat every 10 s and warn after 2 minutes of failed heartbeats, so a live "
        "client misses 11 in a row before this; 0.24.1 never calls finish, so this is what frees "
        "an abandoned client's slots. The silence counts from the later of the last heartbeat "
        "and this controller's start of dispatch (an outage of the controller ends no session). "
        "0 = never.",
        min=0.0,
        max=30 * 86400.0,
    )
    page_idle_seconds: float = setting(
        10.0,
        doc="A bound training run with no open operation and no submission or result for this "
        "long is paged out when registrations wait for a slot of its base model (paging.py): "
        "its exact state goes to the checkpoint store and its next operation pages it back in. "
        "10 s is far above the gaps of a client stepping in a loop (milliseconds) and about a "
        "short sampling phase; a wrong page-out costs that run one snapshot and one restore "
        "(under a second for a small adapter), while a slot held by an idle run makes every "
        "waiting run wait. Nothing is paged while no registration waits. 0 = never page idle "
        "runs (forced page-outs still work).",
        min=0.0,
        max=86400.0,
    )
    max_slots_per_tenant: int = setting(
        0,
        doc="Trainer slots one tenant may hold on a base model's trainers; its further runs "
        "wait (and the pager frees one of its own idle slots for them) while other tenants' "
        "runs take the rest, oldest waiting first. 0 = no cap: a fleet with one tenant, the "
        "default `lorafleet up`, must be able to use every slot; set it to the slots divided "
        "by the tenants that share them.",
        min=0,
        max=1_000_000,
    )
    sweep_interval_seconds: float = setting(
        0.5,
        doc="How often the sweeper looks for gaps, stale claims and expired results.",
        min=0.01,
        max=60.0,
    )
    max_payload_bytes: int = setting(
        16 * 1024 * 1024, doc="Largest serialized operation payload.", min=1024, max=1 << 30
    )
    rpc_timeout_seconds: float = setting(
        600.0, doc="Deadline of data-plane calls to trainers and rollouts.", min=1.0, max=3600.0
    )
    transport_retry_seconds: float = setting(
        30.0,
        doc="How long transport failures to a replica are retried before the op fails.",
        min=0.0,
        max=3600.0,
    )
    rollout_wait_seconds: float = setting(
        300.0,
        doc="How long a sample waits for a rollout to come back (no healthy one, or its own "
        "unreachable) before it fails: a restarting SGLang server on a GPU takes minutes.",
        min=0.0,
        max=3600.0,
    )
    sample_workers: int = setting(
        64,
        doc="Samples one controller runs at once; the rest wait, taken round robin by tenant "
        "(sample_queue.py), so one tenant's flood delays others by a turn, never fails them.",
        min=1,
        max=100_000,
    )
    sample_spread_inflight: int = setting(
        32,
        doc="Samples in flight on a registration's home rollout (from one controller) past "
        "which its next sample goes to a less loaded rollout, which loads the version once: a "
        "hot adapter spreads over replicas.",
        min=1,
        max=1_000_000,
    )
    resident_versions: int = setting(
        3, doc="Published adapter versions kept resident per registration.", min=1, max=64
    )
    discovery: str = setting(
        "self",
        doc="How replicas are found: 'self' (they call RegisterReplica), 'static' (TRAINERS and "
        "ROLLOUTS) or 'kubernetes' (EndpointSlices of TRAINER_SERVICE and ROLLOUT_SERVICE).",
        choices=("self", "static", "kubernetes"),
    )
    trainers: tuple[str, ...] = setting(
        (), doc="Static trainer replicas 'id=host:port,...' (discovery=static)."
    )
    rollouts: tuple[str, ...] = setting(
        (), doc="Static rollout replicas 'id=host:port,...' (discovery=static)."
    )
    trainer_service: str = setting(
        "", doc="Headless Service of the trainer pods (discovery=kubernetes)."
    )
    rollout_service: str = setting(
        "", doc="Headless Service of the rollout pods (discovery=kubernetes)."
    )
    namespace: str = setting(
        "default", doc="Namespace of the Services and of the leader Lease (Kubernetes)."
    )
    replica_id: str = setting(
        "", doc="This controller's identity in the Lease (the pod name); empty = the hostname."
    )
    leader_election: bool = setting(
        False,
        doc="Elect one dispatching controller through a coordination.k8s.io Lease; standbys "
        "report ControllerService NOT_SERVING.",
    )
    lease_name: str = setting("lorafleet-controller", doc="Name of the leader Lease.")
    lease_duration_seconds: float = setting(
        15.0,
        doc="A candidate takes over a lease not renewed for this long.",
        min=1.0,
        max=3600.0,
    )
    lease_renew_deadline_seconds: float = setting(
        10.0,
        doc="The leader steps down when it could not renew for this long (< duration).",
        min=0.1,
        max=3600.0,
    )
    lease_retry_period_seconds: float = setting(
        2.0,
        doc="Interval between acquire/renew attempts (< renew deadline).",
        min=0.05,
        max=600.0,
    )
