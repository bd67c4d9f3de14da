"""The native decode kernels as the package builds them: the header check that fails a
build, the build without a compiler, every variant this CPU runs against torch, and the
loader's refusals (missing library, stale library), each reported as the torch path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorafleet_rollout import kernel_abi, kernels

ROLLOUT = Path(__file__).resolve().parents[1]


def test_header_matches_the_ctypes_declarations() -> None:
    header = kernel_abi.HEADER.read_text()
    kernel_abi.check_header(header)  # what the build checks
    assert set(kernel_abi.header_signatures(header)) == set(kernel_abi.SIGNATURES)

    wider = header.replace("int32_t rows, int32_t kv_heads,", "int64_t rows, int32_t kv_heads,")
    assert wider != header
    wrong = r"decode_attention: parameter 8 is int64_t in kernels\.h, int32_t in kernel_abi"
    with pytest.raises(ValueError, match=wrong):
        kernel_abi.check_header(wider)
    fewer = header.replace("float *total, float *scratch);", "float *total);", 1)
    with pytest.raises(ValueError, match=r"decode_attention: 18 parameters in kernels\.h, 19"):
        kernel_abi.check_header(fewer)
    extra = header + "\nLORAFLEET_EXPORT void decode_new(float *x);\n"
    with pytest.raises(ValueError, match=r"decode_new: in kernels\.h, not in kernel_abi"):
        kernel_abi.check_header(extra)


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """The rollout package's build inputs (setup.py, pyproject.toml, src), without built
    libraries, in a scratch folder."""
    copy = tmp_path / "rollout"
    copy.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROLLOUT / name, copy / name)
    shutil.copytree(
        ROLLOUT / "src", copy / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return copy


def _build(package: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """setup.py build_ext of a package copy into its own build folder."""
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "tmp"],
        cwd=package,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_signature_mismatch_fails_the_build(package_copy: Path) -> None:
    header = package_copy / "src/lorafleet_rollout/csrc/kernels.h"
    text = header.read_text()
    header.write_text(
        text.replace("int32_t n, const int32_t *col_lo", "int64_t n, const int32_t *col_lo")
    )
    built = _build(package_copy)
    assert built.returncode != 0
    wrong = "decode_lora: parameter 11 is int64_t in kernels.h, int32_t in kernel_abi"
    assert wrong in built.stderr
    assert not list((package_copy / "out").rglob("*.so"))


def test_without_a_compiler_the_package_still_builds(package_copy: Path) -> None:
    built = _build(package_copy, CC="false", LDSHARED="false")
    assert built.returncode == 0, built.stderr
    assert "building optional extension" in built.stderr or "failed" in built.stderr
    assert not list((package_copy / "out").rglob("*.so"))


def test_the_build_makes_one_library_per_variant(package_copy: Path) -> None:
    built = _build(package_copy)
    assert built.returncode == 0, built.stderr
    names = sorted(p.name.split(".")[0] for p in (package_copy / "out").rglob("*.so"))
    variants = kernel_abi.VARIANTS.get(os.uname().machine, ())
    assert names == sorted(kernel_abi.module_name(v) for v, _flags, _cpu in variants)


def _attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    for r, n in enumerate(lengths):
        scores = (q[r] @ keys[r, :, :n].transpose(-1, -2)) * scale
        out[r] = torch.softmax(scores, -1) @ values[r, :, :n]
    return out


@pytest.mark.parametrize("variant", [v for v, _flags, _cpu in kernel_abi.VARIANTS["x86_64"]])
def test_each_variant_equals_torch(variant: str) -> None:
    """Attention over ragged rows (dims with and without a vector tail, short rows and long
    ones), the shared-segment merge on its lane path, and LoRA over slots, per variant,
    within float rounding."""
    if variant not in kernels.runnable_variants():
        pytest.skip(f"this CPU cannot run {variant}")
    try:
        native = kernels.load_variant(variant)
    except kernels.KernelsUnavailable as exc:
        pytest.skip(f"no native kernels: {exc}")
    assert native.variant == variant
    gen = torch.Generator().manual_seed(1)
    for dim in (64, 20):
        rows, kv_heads, group, columns, scale = 5, 2, 3, 300, dim**-0.5
        q = torch.randn(rows, kv_heads, group, dim, generator=gen)
        keys = torch.randn(rows, kv_heads, columns, dim, generator=gen)
        values = torch.randn(rows, kv_heads, columns, dim, generator=gen)
        k, v = torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
        # Both paths: two passes up to 128 columns, one pass (blocks of 16, a ragged last
        # one) beyond.
        lengths = [300, 1, 129, 128, 37]
        out, peak, total = native.attention(
            q, k, v, keys, values, torch.tensor(lengths, dtype=torch.int32), columns, scale
        )
        for r, n in enumerate(lengths):  # the kernel wrote this step's k, v at column n - 1
            assert torch.equal(keys[r, :, n - 1], k[r]) and torch.equal(values[r, :, n - 1], v[r])
        want = _attention_reference(q, keys, values, lengths, scale)
        assert (out - want).abs().max() <= 1e-5

        seg_k = torch.randn(kv_heads, 50, dim, generator=gen)
        seg_v = torch.randn(kv_heads, 50, dim, generator=gen)
        members = [4, 0, 2]  # 9 query heads: the lane path
        call = native.shared.bind(
            [([(seg_k, seg_v)], torch.tensor(members))], kv_heads, group, dim, scale
        )
        call(0, q, out, peak, total)
        for r in members:
            n = lengths[r]
            joined_k = torch.cat((keys[r : r + 1, :, :n], seg_k.unsqueeze(0)), 2)
            joined_v = torch.cat((values[r : r + 1, :, :n], seg_v.unsqueeze(0)), 2)
            want = _attention_reference(q[r : r + 1], joined_k, joined_v, [n + 50], scale)
            assert (out[r] - want[0]).abs().max() <= 1e-5

    slots, inputs, rank, outputs = 3, 48, 5, 40
    a = torch.randn(slots, inputs, rank, generator=gen)
    b = torch.randn(slots, rank, outputs, generator=gen)
    x = torch.randn(6, inputs, generator=gen)
    base = torch.randn(6, outputs, generator=gen)
    order = torch.tensor([1, 4, 0, 5, 2], dtype=torch.int32)  # row 3 has no adapter
    row_slots = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)
    everywhere = (
        torch.zeros(rank, dtype=torch.int32),
        torch.full((rank,), outputs, dtype=torch.int32),
    )
    out = base.clone()
    native.lora.bind(a, b, order, row_slots, everywhere, outputs)(out, x)
    want = base.clone()
    for r, s in zip(order.tolist(), row_slots.tolist(), strict=True):
        want[r] += x[r] @ a[s] @ b[s]
    assert (out - want).abs().max() <= 1e-4
    assert torch.equal(out[3], base[3])

    # A fused projection of two sub-projections (outputs 40 and 24): each's rank columns
    # reach only its own outputs, their B rows holding them from column 0 (width 40).
    fused_a = torch.randn(slots, inputs, 2 * rank, generator=gen)
    fused_b = torch.randn(slots, 2 * rank, outputs, generator=gen)
    fused_b[:, rank:, 24:] = float("nan")  # past the second's 24 outputs: never read
    lo = torch.tensor([0] * rank + [40] * rank, dtype=torch.int32)
    hi = torch.tensor([40] * rank + [64] * rank, dtype=torch.int32)
    base = torch.randn(6, 64, generator=gen)
    out = base.clone()
    native.lora.bind(fused_a, fused_b, order, row_slots, (lo, hi), 64)(out, x)
    want = base.clone()
    for r, s in zip(order.tolist(), row_slots.tolist(), strict=True):
        h = x[r] @ fused_a[s]
        want[r, :40] += h[:rank] @ fused_b[s, :rank, :40]
        want[r, 40:] += h[rank:] @ fused_b[s, rank:, :24]
    assert (out - want).abs().max() <= 1e-4
    assert torch.equal(out[3], base[3])


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """kernels.load() forgets what it loaded, before and after the test."""
    kernels._load.cache_clear()
    try:
        yield
    finally:
        kernels._load.cache_clear()


def test_a_missing_library_means_the_torch_path(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "_library_file", lambda variant: None)
    assert kernels.load() is None
    assert kernels.path() == kernels.TORCH
    assert "without a working C compiler" in kernels.unavailable_reason()


def test_a_library_built_from_other_sources_is_refused(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels.runnable_variants() or kernels.load() is None:
        pytest.skip(f"no native kernels: {kernels.unavailable_reason()}")
    kernels._load.cache_clear()
    monkeypatch.setattr(kernel_abi, "sources_digest", lambda variant: "0" * 32)
    assert kernels.path() == kernels.TORCH
    assert "built from other sources" in kernels.unavailable_reason()
