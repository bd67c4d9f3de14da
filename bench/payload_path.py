"""The controller's CPU per forward_backward, with the payload passed once (as now) and as it
was handled before issue 24 item 3 (parsed, re-serialised and re-hashed in canonical form on
admission, parsed again at dispatch and wrapped into the trainer's item; the result parsed
out of the trainer's answer, wrapped and serialised to store, parsed again for GetOperation).

    .venv/bin/python bench/payload_path.py [--batch 8] [--seq 128] [--rounds 200]

Both paths run here side by side on the same bytes (a batch x seq cross-entropy payload with
targets and weights, and its logprobs/elementwise-loss result), gRPC and Redis left out: what
is measured is only the work the controller's own code does on the payload. Prints one JSON
object: microseconds per operation for each path, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2
from lorafleet_controller import validate


def tensor(arr: np.ndarray, dtype: int) -> common_pb2.Tensor:
    return common_pb2.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


def payload(batch: int, seq: int) -> bytes:
    rng = np.random.default_rng(0)
    data = [
        common_pb2.Datum(
            tokens=rng.integers(10, 2000, seq).tolist(),
            loss_fn_inputs={
                "target_tokens": tensor(rng.integers(10, 2000, seq), common_pb2.DTYPE_INT64),
                "weights": tensor(np.ones(seq, "<f4"), common_pb2.DTYPE_FLOAT32),
            },
        )
        for _ in range(batch)
    ]
    fb = common_pb2.ForwardBackwardInput(data=data, loss_fn="cross_entropy")
    return controller_pb2.OperationPayload(forward_backward=fb).SerializeToString(
        deterministic=True
    )


def result(batch: int, seq: int) -> bytes:
    rng = np.random.default_rng(1)
    outs = [
        common_pb2.DatumOutput(
            outputs={
                "logprobs": tensor(-rng.random(seq, "<f4"), common_pb2.DTYPE_FLOAT32),
                "elementwise_loss": tensor(rng.random(seq, "<f4"), common_pb2.DTYPE_FLOAT32),
            }
        )
        for _ in range(batch)
    ]
    out = common_pb2.ForwardBackwardOutput(outputs=outs, metrics={"loss:sum": 1.0})
    return controller_pb2.OperationResult(forward_backward=out).SerializeToString()


def before(body: bytes, answer: bytes) -> None:
    """What the controller did per forward_backward before: the gRPC request arrived parsed."""
    parsed = controller_pb2.OperationPayload.FromString(body)  # grpc's parse of the request
    stored = parsed.SerializeToString(deterministic=True)  # admission re-serialised it
    validate.digest(parsed)  # and hashed a canonical copy
    claim = controller_pb2.OperationPayload.FromString(stored)  # dispatch parsed it again
    item = trainer_pb2.ForwardBackwardItem(operation_id="r#1", slot=0, registration_id="r")
    item.payload = claim.SerializeToString()  # the item carried the message, serialised by grpc
    output = controller_pb2.OperationResult.FromString(answer).forward_backward  # grpc's parse
    record = controller_pb2.OperationResult(forward_backward=output).SerializeToString()
    controller_pb2.Operation(result=record).SerializeToString()  # GetOperation: parse + send
    controller_pb2.OperationResult.FromString(record)


def now(body: bytes, answer: bytes) -> None:
    """What it does now: bytes in, bytes out."""
    checked = validate.admit(body)
    assert checked.rejection is None
    item = trainer_pb2.ForwardBackwardItem(
        operation_id="r#1", slot=0, registration_id="r", payload=body
    )
    item.SerializeToString()
    controller_pb2.Operation(result=answer).SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    body, answer = payload(args.batch, args.seq), result(args.batch, args.seq)
    times: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(args.rounds):  # alternate, so machine noise hits both alike
        for name, path in (("before", before), ("now", now)):
            t0 = time.perf_counter()
            path(body, answer)
            times[name].append(time.perf_counter() - t0)
    us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    print(
        json.dumps(
            {
                "payload_bytes": len(body),
                "result_bytes": len(answer),
                "before_us": round(us["before"], 1),
                "now_us": round(us["now"], 1),
                "before_over_now": round(us["before"] / us["now"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
