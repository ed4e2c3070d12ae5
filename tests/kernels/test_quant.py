"""Quantized weights: every GGUF format dequantizes exactly as the gguf package does; activations
quantize as the reference; the integer matmul, and the bf16 one (bf16 activations against the
weights rounded to bf16), match float64 math on the same values and give a row the same bits
whatever the batch, the tile it lands in, the thread count, or the weight's layout (rows as GGUF
stores them, or packed in panels as the model loads them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from helpers.quant_blocks import FORMATS, in_layout, random_blocks
from reference import quant as ref

from mindie import _C, ops

# (format, packed) for every layout a format comes in.
LAYOUTS = [(fmt, packed) for packed in (False, True) for fmt in FORMATS]

# The int8 products take VNNI where the CPU has it (AVX512-VNNI in the AVX-512 variant, AVX-VNNI in
# the AVX2 one) and vpmaddubsw / vpmaddwd where it has not, and the AVX-512 variant's bf16 products
# (and its int8 rows from 32 on, unsigned q over 32-value spans) AMX tiles where the CPU has them and
# vdpbf16ps (vpdpbusd) where it has not: on such a CPU every form runs, the others as "avx512-novnni",
# "avx2-novnni" and "avx512-noamx".
_ISAS = _C.available_isas()
_FEATURES = _C.cpu_features()
VARIANTS = (_ISAS + (["avx512-novnni"] if "avx512" in _ISAS and _FEATURES["avx512_vnni"] else [])
            + (["avx2-novnni"] if "avx2" in _ISAS and _FEATURES["avx_vnni"] else [])
            + (["avx512-noamx"] if "avx512" in _ISAS and _FEATURES["amx_bf16"] else []))


@pytest.fixture(params=VARIANTS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per kernel variant (and product form) this build has and this CPU runs."""
    previous = _C.get_isa()
    _C.set_isa(request.param.split("-")[0])
    _C.set_vnni(not request.param.endswith("-novnni"))
    _C.set_amx(not request.param.endswith("-noamx"))
    yield request.param
    _C.set_isa(previous)
    _C.set_vnni(True)
    _C.set_amx(True)


def cols_for(fmt: str) -> list[int]:
    return [256, 768] if fmt.endswith("_K") else [32, 96, 576]


@pytest.mark.parametrize("fmt,packed", LAYOUTS)
def test_dequantize_matches_gguf(isa, fmt, packed):
    for rows, cols in ((7, cols) for cols in cols_for(fmt)):
        data, qtype = random_blocks(fmt, rows, cols, cols)
        weight, layout = in_layout(data, qtype, packed)
        torch.testing.assert_close(ops.dequantize(weight, qtype, cols, **layout), ref.dequantize(data, qtype, cols),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_panel_holds_its_rows_bytes(fmt):
    """Panel p holds the bytes of rows 16p..16p+15, rearranged (where to: dequantize checks; Q5_0 and
    Q5_1 also move qh's bits within its 4 bytes); zero rows pad the last panel."""
    data, qtype = random_blocks(fmt, 37, cols_for(fmt)[0], 2)
    packed = ops.pack_panels(data, qtype)
    assert packed.shape == (48, data.shape[1])
    padded = torch.cat([data, torch.zeros(11, data.shape[1], dtype=torch.uint8)])
    bits = torch.tensor([bin(b).count("1") for b in range(256)])
    for p in range(3):
        rows = slice(16 * p, 16 * p + 16)
        assert bits[packed[rows].long()].sum() == bits[padded[rows].long()].sum()
        if fmt not in ("Q5_0", "Q5_1"):
            assert torch.equal(packed[rows].flatten().sort().values, padded[rows].flatten().sort().values)


@dataclass(frozen=True)
class Form:
    """One activation form of the quantized matmul: how rows are prepared, the kernel, its reference."""

    prepare: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    kernel: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    atol: float  # of the largest reference value


FORMS = {
    "int8": Form(ops.quantize_activations, ops.qmatmul, ref.qmatmul, 1e-4),
    # --activation-bits 8: the lo plane zeros, and skipped by the kernels that take it apart
    "int8-one-plane": Form(partial(ops.quantize_activations, planes=1), partial(ops.qmatmul, planes=1), ref.qmatmul,
                           1e-4),
    # The kernel rounds scale * q + offset once (fma), gguf twice: a weight near a bf16 tie may round
    # one bf16 step apart, about 2^-9 of one product.
    "bf16": Form(lambda x: (x.bfloat16(),), ops.qmatmul_bf16, ref.qmatmul_bf16, 2e-3),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt,packed", LAYOUTS)
@pytest.mark.parametrize("m,n", [(1, 1), (1, 37), (3, 8), (17, 5), (64, 33)])
def test_qmatmul_matches_reference(isa, form, fmt, packed, m, n):
    f = FORMS[form]
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, n, k, m * 100 + n)
    weight, layout = in_layout(data, qtype, packed)
    gen = torch.Generator().manual_seed(n)
    x = f.prepare(torch.randn(m, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    want = f.reference(*x, data, qtype, bias)
    torch.testing.assert_close(f.kernel(*x, weight, qtype, bias, **layout), want,
                               atol=f.atol * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt,packed", [(fmt, True) for fmt in FORMATS] + [("Q4_1", False), ("Q6_K", False)])
def test_qmatmul_rows_are_batch_invariant(isa, form, fmt, packed):
    """Row i of a batch of M equals row i computed in any other batch, for M = 1..64 (every register
    tile shape and tail), with one kernel thread or several, and in either layout of the weight; 45
    weight rows end in a partial panel (zero rows in a packed matrix, packed when staged in the
    row layout) and in a narrower group of panels. Up to 8 rows against a packed matrix take the
    streaming (decode) path, which reads the panels where they lie."""
    f = FORMS[form]
    threads = _C.get_num_threads()
    try:
        for k in cols_for(fmt)[1:]:  # an odd count of 32-value blocks, then a longer row
            data, qtype = random_blocks(fmt, 45, k, 3)
            x = f.prepare(torch.randn(64, k, generator=torch.Generator().manual_seed(4)))
            full = f.kernel(*x, data, qtype)
            weight, layout = in_layout(data, qtype, packed)
            for t in sorted({1, threads, 3}):
                _C.set_num_threads(t)
                for m in range(1, 65):
                    got = f.kernel(*(a[64 - m:] for a in x), weight, qtype, **layout)
                    assert torch.equal(got, full[64 - m:]), (k, t, m)
    finally:
        _C.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K", "Q8_0"])
def test_qmatmul_rows_of_a_long_prompt_match_the_reference_and_the_rows_alone(isa, fmt):
    """A call of 600 rows (which the AVX2 variant takes 256 rows at a time) matches the reference,
    and each row has the bits a call of a few rows gives it, at the edges of those chunks too."""
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, 40, k, 5)
    weight, layout = in_layout(data, qtype, True)
    xq, xd = ops.quantize_activations(torch.randn(600, k, generator=torch.Generator().manual_seed(6)))
    full = ops.qmatmul(xq, xd, weight, qtype, **layout)
    want = ref.qmatmul(xq, xd, data, qtype, None)
    torch.testing.assert_close(full, want, atol=FORMS["int8"].atol * want.abs().max().item(), rtol=1e-5)
    for r0, n in [(0, 9), (250, 12), (505, 10), (588, 12)]:  # more than 8 rows: the prompt tile's path
        assert torch.equal(ops.qmatmul(xq[r0:r0 + n], xd[r0:r0 + n], weight, qtype, **layout), full[r0:r0 + n])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_decode_rows_do_not_depend_on_which_thread_claims_a_panel(isa, fmt):
    """At decode the threads claim ranges of panels as they go in calls of 1 MiB or more (a share of
    what is left, so a thread that is descheduled holds up little): over such a matrix, in a group with
    a second one, every row of 1 to 8 activation rows gets the bits one thread gives, whatever the
    thread count."""
    k = 2048
    group = []
    for j, rows in enumerate((16 * 200 + 5, 16 * 11)):
        data, qtype = random_blocks(fmt, rows, k, 10 + j)
        group.append((qtype, ops.pack_panels(data, qtype), k, rows, True))
    threads = _C.get_num_threads()
    try:
        for m in (1, 3, 8):
            q, d = ops.quantize_activations(torch.randn(m, k, generator=torch.Generator().manual_seed(m)))
            _C.set_num_threads(1)
            alone = ops.qmatmul_group(q, d, group)
            for t in sorted({2, 3, threads}):
                _C.set_num_threads(t)
                for _ in range(3):
                    for got, want in zip(ops.qmatmul_group(q, d, group), alone, strict=True):
                        assert torch.equal(got, want), (m, t)
    finally:
        _C.set_num_threads(threads)


@pytest.mark.parametrize("m", [1, 5, 20])
def test_a_group_of_matrices_gives_each_its_own_result(isa, m):
    """qmatmul_group (q/k/v or gate/up in one call, their rows split over the threads as one range)
    gives every matrix, whatever its format or layout, the bits a call of its own gives."""
    k = 256
    weights = []
    for j, (fmt, packed) in enumerate([("Q4_1", True), ("Q8_0", True), ("Q4_K", False), ("Q4_0", False)]):
        data, qtype = random_blocks(fmt, 16 * j + 7, k, j)
        weight, layout = in_layout(data, qtype, packed)
        weights.append((qtype, weight, k, data.shape[0], packed))
    q, d = ops.quantize_activations(torch.randn(m, k, generator=torch.Generator().manual_seed(m)))
    for group in (weights[:3], weights):
        for got, (qtype, weight, _, rows, packed) in zip(ops.qmatmul_group(q, d, group), group, strict=True):
            assert torch.equal(got, ops.qmatmul(q, d, weight, qtype, packed_rows=rows if packed else None))


@pytest.mark.parametrize("m", [1, 3])
def test_a_batch_of_calls_gives_each_its_own_result(isa, m):
    """qmatmul_batch (a layer's routed experts: each call its own input and matrices, walked as one
    range of panels) gives every matrix the bits a call of its own gives, whatever the thread count,
    for calls that stream together (packed, one row count, different k) and for those that cannot
    (a row layout, another row count), which run alone."""
    calls = []
    for j, (fmt, k, rows) in enumerate([("Q4_K", 512, 16 * 40 + 3), ("Q6_K", 256, 16 * 9), ("Q4_0", 2048, 16 * 30),
                                        ("Q8_0", 96, 21)]):
        group = []
        for t in range(2 if j % 2 == 0 else 1):  # gate and up share an input; down stands alone
            data, qtype = random_blocks(fmt, rows + t, k, 10 * j + t)
            group.append((qtype, ops.pack_panels(data, qtype), k, rows + t, True))
        q, d = ops.quantize_activations(torch.randn(m, k, generator=torch.Generator().manual_seed(j)))
        calls.append((q, d, group))
    q, d = ops.quantize_activations(torch.randn(m + 1, 256, generator=torch.Generator().manual_seed(9)))
    data, qtype = random_blocks("Q4_K", 37, 256, 99)
    odd = [(q, d, [(qtype, data, 256, 37, False)])]  # another row count, and a row layout
    threads = _C.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            _C.set_num_threads(t)
            for batch in (calls, calls + odd, calls[:1]):
                got = ops.qmatmul_batch(batch)
                for outs, (xq, xd, group) in zip(got, batch, strict=True):
                    for out, want in zip(outs, ops.qmatmul_group(xq, xd, group), strict=True):
                        assert torch.equal(out, want), (t, len(batch))
    finally:
        _C.set_num_threads(threads)
    with pytest.raises(ValueError, match="at most 16"):
        ops.qmatmul_batch(calls * 5)


@pytest.mark.parametrize("planes", [1, 2])
def test_quantize_activations_matches_the_reference(isa, planes):
    """Both planes as the reference rounds them (hi to 127 steps of the block's largest magnitude, lo
    to 1/128 of a step); with one plane the same hi and d, and lo zeros: each value within half a
    step of hi's, against 1/256 of a step with two planes."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(planes)) * torch.logspace(-3, 2, 256)
    q, d = ops.quantize_activations(x, planes=planes)
    want_q, want_d = ref.quantize_activations(x, planes)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    step = d.repeat_interleave(32, 1) * 128
    err = (ref.activations_value(q, d) - x.double()).abs() / step
    assert err.max().item() <= (0.5 if planes == 1 else 1 / 256) + 1e-4
    if planes == 1:
        assert not q[:, 1].any() and torch.equal(q[:, 0], ops.quantize_activations(x)[0][:, 0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_plane_kernels_give_the_bits_of_both_planes_with_lo_zero(isa, fmt):
    """planes=1 skips the lo plane (the byte tile and the streaming GEMV take half the products; Q8_0
    moves from the int16 tile to the byte tile): every row count and thread count gives the bits the
    two-plane kernels give on the same activations, whose lo plane is zeros."""
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, 45, k, 5)
    packed = ops.pack_panels(data, qtype)
    threads = _C.get_num_threads()
    try:
        for t in sorted({1, threads}):
            _C.set_num_threads(t)
            for m in (1, 2, 5, 8, 9, 13, 64):
                q, d = ops.quantize_activations(torch.randn(m, k, generator=torch.Generator().manual_seed(m)), planes=1)
                for weight, rows in ((packed, 45), (data, None)):
                    one = ops.qmatmul(q, d, weight, qtype, packed_rows=rows, planes=1)
                    assert torch.equal(one, ops.qmatmul(q, d, weight, qtype, packed_rows=rows)), (t, m, rows)
                group = [(qtype, packed, k, 45, True), (qtype, data, k, 45, False)]
                for a, b in zip(ops.qmatmul_group(q, d, group, planes=1), ops.qmatmul_group(q, d, group), strict=True):
                    assert torch.equal(a, b)
                batch = [(q, d, group[:1]), (q, d, group[:1])]
                for a, b in zip(ops.qmatmul_batch(batch, planes=1), ops.qmatmul_batch(batch), strict=True):
                    assert torch.equal(a[0], b[0])
    finally:
        _C.set_num_threads(threads)


def test_round_to_bf16_matches_torch(isa):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 45, generator=gen) * torch.logspace(-30, 30, 45)  # odd width: a partial vector
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])
    assert torch.equal(ops.round_to_bf16(x), x.bfloat16())


def bf16_product(x: torch.Tensor, data: torch.Tensor, qtype: int, isa: str, tiles: bool) -> tuple[torch.Tensor, bool]:
    """qmatmul_bf16 on kernel variant `isa`, with or without AMX tiles, and whether that variant ran native
    bf16 products; the settings are restored after."""
    previous = _C.get_isa()
    try:
        _C.set_isa(isa)
        _C.set_amx(tiles)
        return ops.qmatmul_bf16(x, data, qtype), _C.qmatmul_bf16_native()
    finally:
        _C.set_isa(previous)
        _C.set_amx(True)


@pytest.mark.skipif("avx512" not in _C.available_isas() or not _C.cpu_features()["avx512_bf16"],
                    reason="needs a CPU with AVX512-BF16 to compare vdpbf16ps with the emulation")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_qmatmul_bf16_native_agrees_with_the_emulation(fmt):
    """vdpbf16ps and the float emulation the other variants run add the same exact products in the
    same order; they may differ only where vdpbf16ps flushes denormals."""
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, 70, k, 5)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    native, was_native = bf16_product(x, data, qtype, "avx512", tiles=False)
    emulated, was_emulated = bf16_product(x, data, qtype, "scalar", tiles=False)
    assert was_native and not was_emulated
    torch.testing.assert_close(native, emulated, atol=1e-6 * emulated.abs().max().item(), rtol=0)


@pytest.mark.skipif("avx512" not in _C.available_isas() or not _C.cpu_features()["amx_bf16"],
                    reason="needs a CPU (and OS) with AMX-BF16 to compare the tiles with vdpbf16ps")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_qmatmul_bf16_on_amx_tiles_agrees_with_vdpbf16ps(fmt):
    """The tiles add the same exact bf16 products as vdpbf16ps, 32 at a time in their own rounding:
    the sums agree to float32 rounding, for whole and partial blocks of 16 rows."""
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, 70, k, 5)
    for rows in (1, 16, 37):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).bfloat16()
        tiles, _ = bf16_product(x, data, qtype, "avx512", tiles=True)
        vdpbf16ps, _ = bf16_product(x, data, qtype, "avx512", tiles=False)
        assert not torch.equal(tiles, torch.zeros_like(tiles))
        bound = (x.float().abs() @ ref.dequantize(data, qtype, k).abs().T) * 2**-20
        assert ((tiles - vdpbf16ps).abs() <= bound).all(), rows


@pytest.mark.skipif("avx512" not in _C.available_isas() or not _C.cpu_features()["amx_bf16"],
                    reason="needs a CPU (and OS) with AMX-BF16")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K"])
def test_qmatmul_bf16_on_amx_tiles_gives_the_same_bits_wherever_k_is_cut(fmt):
    """The tiles take k in equal chunks of at most 2048 values, each output's float32 sums carried
    from one chunk to the next: where the cuts fall leaves the bits as they are. 4352 values (chunks
    of 1472, 1472 and 1408) give exactly what the same products padded to 4608 with zero weights give
    (three chunks of 1536), each row alone gives its bits in the batch, and all agree with vdpbf16ps
    to float32 rounding."""
    k, pad = 4352, 256
    data, qtype = random_blocks(fmt, 40, k, 3)
    padded = torch.cat([data, torch.zeros(data.shape[0], data.shape[1] * pad // k, dtype=torch.uint8)], 1)
    x = torch.randn(37, k + pad, generator=torch.Generator().manual_seed(4)).bfloat16()
    cut, _ = bf16_product(x[:, :k].contiguous(), data, qtype, "avx512", tiles=True)
    whole, _ = bf16_product(x, padded, qtype, "avx512", tiles=True)
    assert torch.equal(cut, whole)
    rows = [x[i:i + 1, :k].contiguous() for i in range(37)]
    alone = torch.cat([bf16_product(row, data, qtype, "avx512", tiles=True)[0] for row in rows])
    assert torch.equal(cut, alone)
    vdpbf16ps, _ = bf16_product(x[:, :k].contiguous(), data, qtype, "avx512", tiles=False)
    bound = (x[:, :k].float().abs() @ ref.dequantize(data, qtype, k).abs().T) * 2**-20
    assert ((cut - vdpbf16ps).abs() <= bound).all()


@pytest.mark.skipif("avx512" not in _C.available_isas() or not _C.cpu_features()["amx_bf16"],
                    reason="needs a CPU (and OS) with AMX-BF16")
def test_large_outputs_written_past_the_caches_hold_the_same_bits():
    """A bf16 matmul whose output passes 16 MB writes whole panels' floats with streaming stores where
    they start a cache line (here every other row: 8200 floats a row): the same bits as each row
    computed alone, whose small output is written the ordinary way, and the partial last panel too."""
    data, qtype = random_blocks("Q4_0", 8200, 64, 11)
    weight = ops.pack_panels(data, qtype)
    x = torch.randn(520, 64, generator=torch.Generator().manual_seed(12)).bfloat16()
    previous = _C.get_isa()
    try:
        _C.set_isa("avx512")
        big = ops.qmatmul_bf16(x, weight, qtype, packed_rows=8200)
        assert big.numel() * 4 > 16 << 20
        for i in (0, 1, 255, 519):
            assert torch.equal(big[i], ops.qmatmul_bf16(x[i:i + 1], weight, qtype, packed_rows=8200)[0]), i
    finally:
        _C.set_isa(previous)
    want = x.double() @ ref.dequantize(data, qtype, 64).bfloat16().double().T  # each weight rounded to bf16
    torch.testing.assert_close(big.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_arguments_raise():
    data, qtype = random_blocks("Q4_1", 4, 64, 0)
    q, d = ops.quantize_activations(torch.randn(2, 64))
    with pytest.raises(ValueError, match="ggml type 99"):
        ops.qmatmul(q, d, data, 99)
    with pytest.raises(ValueError, match="bytes per row"):
        ops.qmatmul(q, d, data[:, :20].contiguous(), qtype)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize_activations(torch.randn(2, 40))
    with pytest.raises(ValueError, match="planes must be 1 or 2, got 3"):
        ops.quantize_activations(torch.randn(2, 64), planes=3)
    with pytest.raises(ValueError, match="planes must be 1 or 2, got 0"):
        ops.qmatmul(q, d, data, qtype, planes=0)
    with pytest.raises(ValueError, match="row 0's lo plane is not zeros"):  # two-plane rows, their lo skipped
        ops.qmatmul(q, d, data, qtype, planes=1)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        ops.qmatmul_bf16(torch.randn(2, 64), data, qtype)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.qmatmul_bf16(torch.randn(2, 40).bfloat16(), data, qtype)
    packed = ops.pack_panels(data, qtype)
    with pytest.raises(ValueError, match="rounded up to 16"):
        ops.qmatmul(q, d, packed, qtype, packed_rows=17)
    with pytest.raises(ValueError, match="at least one row"):
        ops.qmatmul(q, d, packed, qtype, packed_rows=0)
    with pytest.raises(ValueError, match="1 to 4 matrices"):
        ops.qmatmul_group(q, d, [(qtype, data, 64, 4, False)] * 5)
    with pytest.raises(ValueError, match="as many columns as xq"):
        ops.qmatmul_group(q, d, [(qtype, random_blocks("Q4_1", 4, 96, 0)[0], 96, 4, False)])


@pytest.mark.parametrize("variant", [v.removesuffix("-novnni") for v in VARIANTS if v.endswith("-novnni")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_gives_the_same_bits_as_the_products_without_it(variant, fmt):
    """VNNI (vpdpbusd, vpdpwssd) sums the same exact int32 values as vpmaddubsw / vpmaddwd: decode
    rows (the streaming GEMV), a decode batch and a prompt's rows (the tiles) get the same bits."""
    previous = _C.get_isa()
    k = cols_for(fmt)[-1]
    data, qtype = random_blocks(fmt, 45, k, 5)
    weight, layout = in_layout(data, qtype, True)
    x = ops.quantize_activations(torch.randn(40, k, generator=torch.Generator().manual_seed(6)))
    try:
        _C.set_isa(variant)
        for m in (1, 3, 8, 9, 40):
            rows = [a[:m] for a in x]
            got = {}
            for vnni in (True, False):
                _C.set_vnni(vnni)
                got[vnni] = ops.qmatmul(*rows, weight, qtype, **layout)
            assert torch.equal(got[True], got[False]), m
    finally:
        _C.set_isa(previous)
        _C.set_vnni(True)


@pytest.mark.skipif("avx512" not in _ISAS, reason="needs the AVX-512 variant")
@pytest.mark.parametrize("fmt", FORMATS)
def test_burst_prefetch_gives_the_same_bits_as_the_spread_one(fmt):
    """The AVX-512 decode GEMV at one row prefetches the panel ahead in a burst per block or spread
    over its dot products (set_burst_prefetch): only when the bytes arrive differs. A matrix the
    threads claim panels of (1 MiB and more) and a small one get the same bits either way, and match
    the reference."""
    previous, burst, threads = _C.get_isa(), _C.burst_prefetch(), _C.get_num_threads()
    k = cols_for(fmt)[-1]
    try:
        _C.set_isa("avx512")
        for rows in (16 * 5 + 3, 16 * 400 + 9):
            data, qtype = random_blocks(fmt, rows, k, rows)
            weight, layout = in_layout(data, qtype, True)
            q, d = ops.quantize_activations(torch.randn(1, k, generator=torch.Generator().manual_seed(rows)))
            want = ref.qmatmul(q, d, data, qtype, None)
            for t in sorted({1, 2, threads}):
                _C.set_num_threads(t)
                got = {}
                for on in (False, True):
                    _C.set_burst_prefetch(on)
                    got[on] = ops.qmatmul(q, d, weight, qtype, **layout)
                assert torch.equal(got[True], got[False]), (rows, t)
                atol = FORMS["int8"].atol * want.abs().max().item()
                torch.testing.assert_close(got[True], want, atol=atol, rtol=1e-5)
    finally:
        _C.set_isa(previous)
        _C.set_burst_prefetch(burst)
        _C.set_num_threads(threads)


# Where the quantized values of a block lie (after the scales), per format: set to 0xFF they make every
# q the format's largest, 15 or 31.
_QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144),
                "Q5_K": (16, 176)}


@pytest.mark.skipif("avx512" not in _C.available_isas() or not _C.cpu_features()["amx_bf16"],
                    reason="needs AMX-BF16 and the AVX-512 variant")
@pytest.mark.parametrize("fmt", list(_QUANT_BYTES))
def test_int8_rows_on_amx_tiles_are_exact_at_the_largest_sums(fmt):
    """The AMX tiles sum an int8 row's products in float32, exact while a span's sum of |q| times
    |128 * hi + lo| stays below 2^24: every q at its largest against activations whose planes are at
    theirs (hi 126, lo 64, one value of each block at hi 127), all of one sign, give the same bits on
    the tiles as on vpdpbusd and as each row alone on the streaming path."""
    previous = _C.get_isa()
    k = 768 if fmt.endswith("_K") else 576
    data, qtype = random_blocks(fmt, 40, k, 8)
    block = data.view(40, k // (256 if fmt.endswith("_K") else 32), -1)
    lo, hi = _QUANT_BYTES[fmt]
    block[:, :, lo:hi] = 0xFF
    weight, layout = in_layout(data, qtype, True)
    x = torch.full((32, k), 126.5 / 127)
    x[:, ::32] = 1.0
    x[1::2] *= -1  # both signs of the largest sums
    xq, xd = ops.quantize_activations(x)
    assert int(xq[:, 0].abs().max()) == 127 and int(xq[:, 1].abs().max()) == 64
    try:
        _C.set_isa("avx512")
        got = {}
        for amx in (True, False):
            _C.set_amx(amx)
            got[amx] = ops.qmatmul(xq, xd, weight, qtype, **layout)
        alone = torch.cat([ops.qmatmul(xq[i:i + 1], xd[i:i + 1], weight, qtype, **layout) for i in range(32)])
    finally:
        _C.set_isa(previous)
        _C.set_amx(True)
    assert torch.equal(got[True], got[False])
    assert torch.equal(got[True], alone)
    torch.testing.assert_close(got[True], ref.qmatmul(xq, xd, data, qtype, None), rtol=1e-5, atol=1e-3)


def test_dot_peak_counts_the_instructions_the_kernels_use(isa):
    """The benchmarks' register-only peak: positive for each instruction the active variant and the CPU
    run, 0.0 for one they lack or that the kernels are told not to use (VNNI in the -novnni forms, as
    on a CPU without it: the peak a --no-vnni benchmark names is that of its kernels), and an unknown
    name is an error naming the known ones."""
    vnni = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}.get(_C.get_isa())
    has_vnni = vnni is not None and _C.cpu_features()[vnni] and not isa.endswith("-novnni")
    has = {"vpdpbusd": has_vnni, "vdpbf16ps": _C.qmatmul_bf16_native(), "vpmaddubsw": _C.get_isa() != "scalar",
           "vpmaddwd": _C.get_isa() != "scalar", "vpdpwssd": has_vnni,
           "tdpbf16ps": _C.get_isa() == "avx512" and _C.cpu_features()["amx_bf16"] and not isa.endswith("-noamx")}
    for instruction, present in has.items():
        assert (_C.dot_peak(instruction, _C.get_num_threads(), 0.03) > 0) == present, instruction
    with pytest.raises(ValueError, match="vpdpbusd"):
        _C.dot_peak("vfmadd", 1)


def test_large_matrices_pack_to_the_same_bytes_on_huge_pages():
    """pack_panels puts matrices of more than two 2 MiB pages on memory advised as huge pages: the
    bytes are those an ordinary buffer gets, and the tensor is a contiguous [rows rounded to 16, row_bytes]."""
    data, qtype = random_blocks("Q4_0", 16 * 1500 + 3, 4096, 7)
    packed = ops.pack_panels(data, qtype)
    plain = torch.empty_like(packed)
    _C.pack_panels(plain, data, qtype)
    assert packed.is_contiguous() and packed.shape == (16 * 1501, data.shape[1])
    assert torch.equal(packed, plain)
