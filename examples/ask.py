"""Ask a saved adapter questions and check its answers: `python ask.py tinker://... "Q=A" ...`.

Each argument after the path is a question and the text its greedy answer must contain,
separated by '='. The tokenizer comes from `SamplingClient.get_tokenizer()`, which loads the
served base-model name with transformers (it resolves offline on a lorafleet machine).
Exit status 0 when every answer contains what it should.
"""

from __future__ import annotations

import argparse
import os
import sys

import tinker
from common import ask, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a tinker:// saved state or sampler path")
    ap.add_argument("expect", nargs="+", metavar="QUESTION=ANSWER")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    pairs = [item.rpartition("=")[::2] for item in args.expect]
    if any(not q or not a for q, a in pairs):
        ap.error("each expectation is QUESTION=ANSWER")

    sampler = done(tinker.ServiceClient().create_sampling_client(model_path=args.path))
    tok = sampler.get_tokenizer()
    ok = True
    for question, expected in pairs:
        answer = ask(sampler, tok, question, args.max_tokens)
        good = expected.lower() in answer.lower()
        ok &= good
        print(f"{'OK ' if good else 'BAD'} Q: {question}  A: {answer!r}")
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # the SDK's background threads would keep the process alive


if __name__ == "__main__":
    main()
