"""Structured (JSON lines) logging, set up once per process.

Every record carries the service name and, when set, the operation id and registration id
of the work in progress (context variables), so one `grep` follows an operation across
the gateway, controller and trainer logs.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

operation_id: contextvars.ContextVar[str] = contextvars.ContextVar("operation_id", default="")
registration_id: contextvars.ContextVar[str] = contextvars.ContextVar("registration_id", default="")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if op := operation_id.get():
            entry["operation_id"] = op
        if reg := registration_id.get():
            entry["registration_id"] = reg
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
