"""Managed training jobs (issue 13): juno's `/train-qa`, `/train-file-qa`, `/train`,
`/train-file` and `/save`, run by the fleet as ordinary ledger operations.

Pure parts (no Redis, no gRPC): `params` (the job's parameters and their rules), `data`
(Q&A pairs and documents as users send them), `units` (chat-templated phrasings,
completion-only masks, document windows, subsampling, the validation split), `schedule`
(learning rate per optimizer update), `stopping` (early stopping) and `loop` (one job as a
deterministic sequence of operations). `records` keeps jobs durable in Redis and `runner`
executes them through the controller's own ledger path.
"""
