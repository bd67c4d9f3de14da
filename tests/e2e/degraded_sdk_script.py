"""One create_model through the real SDK's client while no healthy trainer serves the model.

Run by tests/e2e/test_supervision.py with a tinker venv's python (TINKER_BASE_URL,
TINKER_API_KEY, SMOKE_BASE_MODEL set). The SDK's own client with retries off, so the first
answer is what is measured (the SDK retries a 503 for minutes by its own policy). Prints one
line "DEGRADED <json>": the HTTP status, the message and the seconds the answer took.
"""

import asyncio
import json
import os
import time

import tinker
from tinker import types
from tinker._client import AsyncTinker  # the SDK's own HTTP client (ServiceClient's)


async def main() -> None:
    client = AsyncTinker(
        base_url=os.environ["TINKER_BASE_URL"], api_key=os.environ["TINKER_API_KEY"], max_retries=0
    )
    session = await client.service.create_session(
        request=types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0")
    )
    request = types.CreateModelRequest(
        session_id=session.session_id,
        model_seq_id=0,
        base_model=os.environ["SMOKE_BASE_MODEL"],
        lora_config=types.LoraConfig(rank=4),
    )
    start = time.monotonic()
    try:
        await client.models.create(request=request)
        status, message = 200, ""
    except tinker.APIStatusError as exc:
        status, message = exc.status_code, str(exc)
    took = time.monotonic() - start
    print("DEGRADED " + json.dumps({"status": status, "message": message, "seconds": took}))


asyncio.run(main())
