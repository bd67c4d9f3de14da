"""One way to hash a file: `lorafleet.digests.sha256_file`.

Manifests, published adapters and the hub cache name files by their SHA-256, so every
service must compute it the same way. This reads every service's and package's source (the
AST) and fails on a function that both makes a SHA-256 and reads a file in blocks: a second
file hasher. The owner, `lorafleet/digests.py`, is the one place allowed to.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
OWNER = Path("packages/lorafleet/src/lorafleet/digests.py")


def _calls(fn: ast.AST, attr: str, with_args: bool) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
        == attr
        and (bool(n.args) or not with_args)
        for n in ast.walk(fn)
    )


def file_hashers(source: str, where: str) -> list[str]:
    return [
        f"{where}:{node.lineno}: {node.name} hashes a file in blocks: use "
        "lorafleet.digests.sha256_file"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _calls(node, "sha256", with_args=False)
        and _calls(node, "read", with_args=True)
    ]


def test_no_second_file_hasher() -> None:
    sources = sorted(
        p.relative_to(REPO)
        for root in ("services", "packages")
        for p in (REPO / root).glob("*/src/**/*.py")
        if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )
    assert len(sources) > 100  # the scan reads the whole tree, not an empty glob
    found = [
        f
        for rel in sources
        if rel != OWNER
        for f in file_hashers((REPO / rel).read_text(), str(rel))
    ]
    assert not found, "\n".join(found)
    assert file_hashers((REPO / OWNER).read_text(), "owner")  # the scan sees the owner's shape


def test_the_scan_tells_a_file_hasher_from_hashing_bytes() -> None:
    hasher = """
def digest(path):
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
"""
    assert file_hashers(hasher, "probe")
    assert not file_hashers("def f(data):\n    return hashlib.sha256(data).hexdigest()", "p")
    assert not file_hashers("def f(p):\n    return sha256(p.read_bytes()).hexdigest()", "p")
