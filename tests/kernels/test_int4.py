"""AWQ INT4 (kernels/int4.py): the packer writes AutoAWQ's nibble order (checked against a word
worked out by hand from the format's order table), unpack inverts it, the quantizer stays within half
a step of the weight, and the Triton dequant-GEMM (interpreted on CPU, compiled on CUDA: gpu mark)
matches torch's matmul on the reference dequantized weight."""

from __future__ import annotations

import pytest
import torch

import kernels.fp8 as fp8
from kernels import int4

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    elif not fp8.INTERPRETED:
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset: this machine has CUDA)")


def test_pack_writes_awqs_interleaved_nibble_order() -> None:
    # AutoAWQ: nibble i of a word holds column order_map[i], order_map = [0, 2, 4, 6, 1, 3, 5, 7];
    # so columns 0..7 holding the values 0..7 give nibbles (low to high) 0,2,4,6,1,3,5,7: 0x75316420.
    assert int4.pack(torch.arange(8, dtype=torch.int32).view(1, 8)).item() == 0x75316420
    # Nibble 7 (column 7) at 8 or more sets the int32's sign bit: 0xF0000000 is -2**28 as int32.
    assert int4.pack(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]])).item() == -(2**28)
    assert int4.pack(torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0]])).item() == 1 << 16, "column 1 is nibble 4"


def test_unpack_inverts_pack() -> None:
    values = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    words = int4.pack(values)
    assert words.dtype == torch.int32 and words.shape == (24, 8)
    assert torch.equal(int4.unpack(words), values)


def test_pack_refuses_what_the_format_cannot_hold() -> None:
    with pytest.raises(ValueError, match="0..15"):
        int4.pack(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 16]]))
    with pytest.raises(ValueError, match="multiple of 8"):
        int4.pack(torch.zeros(2, 12, dtype=torch.int32))


def test_quantize_is_within_half_a_step_of_the_weight() -> None:
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    qweight, qzeros, scales = int4.quantize(weight, 32)
    int4.check_layout(qweight, qzeros, scales, 32)
    assert qweight.shape == (96, 5) and qzeros.shape == (3, 5) and scales.shape == (3, 40)
    restored = int4.dequantize(qweight, qzeros, scales, 32, torch.float32).t()
    step = scales.float().repeat_interleave(32, dim=0).t()
    # Half a step of rounding, plus the fp16 scale's own rounding over 15 steps.
    assert bool(((restored - weight).abs() <= step * 0.5 + step * 15 * 2**-10).all())


def test_dequantize_follows_the_formula() -> None:
    """W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n], element by element, on packed inputs."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (32, 16), generator=generator, dtype=torch.int32)
    z = torch.randint(0, 16, (2, 16), generator=generator, dtype=torch.int32)
    s = torch.rand(2, 16, generator=generator).to(torch.float16)
    w = int4.dequantize(int4.pack(q), int4.pack(z), s, 16, torch.float32)
    for k in range(32):
        for n in range(16):
            assert w[k, n].item() == (q[k, n].item() - z[k // 16, n].item()) * s[k // 16, n].item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "group"), [(1, 32), (5, 16), (37, 64)])
def test_the_kernel_matches_torch_on_the_dequantized_weight(device: str, rows: int, group: int) -> None:
    _device(device)
    generator = torch.Generator().manual_seed(rows)
    # 72 output columns: one full and one partial 64-column tile.
    qweight, qzeros, scales = int4.quantize(torch.randn(72, 128, generator=generator), group)
    x = torch.randn(rows, 128, generator=generator)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        xs, qw, qz, sc = (t.to(device) for t in (x.to(dtype), qweight, qzeros, scales))
        actual = int4.matmul_triton(xs, qw, qz, sc, group)
        expected = xs.float() @ int4.dequantize(qw, qz, sc, group, dtype).float()
        assert actual.dtype == dtype and actual.shape == (rows, 72)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(actual.float(), expected, rtol=tolerance, atol=tolerance * 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_at_an_8b_projection_shape() -> None:
    """Decode and prefill row counts at Llama-3-8B's gate/up shape (4096 -> 2 x 14336), group 128, bf16,
    each at its default launch (decode's and 64 rows' split-K, 200's 64-row tiles, 2048's 128-row ones)."""
    generator = torch.Generator().manual_seed(0)
    qweight, qzeros, scales = (t.cuda() for t in int4.quantize(torch.randn(2 * 14336, 4096, generator=generator), 128))
    for rows in (1, 16, 64, 200, 2048):
        x = torch.randn(rows, 4096, generator=generator).to("cuda", torch.bfloat16)
        actual = int4.matmul_triton(x, qweight, qzeros, scales, 128).float()
        expected = x.float() @ int4.dequantize(qweight, qzeros, scales, 128, torch.bfloat16).float()
        relative = float((actual - expected).norm() / expected.norm())
        assert relative < 1e-2, f"{rows} rows: relative error {relative:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_takes_the_fused_kernel_below_the_crossover_and_cublas_on_the_dequantized_weight_from_it(
        device: str) -> None:  # fmt: skip
    """kernels.int4.matmul: below DEQUANT_MIN_ROWS the fused kernel's result exactly; from there on the
    product of x and the dequantized weight exactly (the dequantizer is the reference bit for bit, so
    this is what torch's matmul gives on the reference's weight)."""
    _device(device)
    generator = torch.Generator().manual_seed(3)
    qweight, qzeros, scales = (t.to(device) for t in int4.quantize(torch.randn(40, 64, generator=generator), 32))
    below = torch.randn(int4.DEQUANT_MIN_ROWS - 1, 64, generator=generator).to(device)
    assert torch.equal(int4.matmul(below, qweight, qzeros, scales, 32),
                       int4.matmul_triton(below, qweight, qzeros, scales, 32))
    at = torch.randn(int4.DEQUANT_MIN_ROWS, 64, generator=generator).to(device)
    assert torch.equal(int4.matmul(at, qweight, qzeros, scales, 32),
                       at @ int4.dequantize(qweight, qzeros, scales, 32, torch.float32))


def test_the_kernel_refuses_bad_shapes() -> None:
    qweight, qzeros, scales = int4.quantize(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="32 columns, the INT4 weight 64 rows"):
        int4.matmul_triton(torch.randn(2, 32), qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        int4.matmul_triton(torch.randn(2, 64), qweight, qzeros, scales, 8)
    with pytest.raises(ValueError, match="scales must be"):
        int4.check_layout(qweight, qzeros, scales[:1], 32)
    with pytest.raises(ValueError, match="float16"):
        int4.check_layout(qweight, qzeros, scales.float(), 32)


# Split-K and the launch configuration (kernels.int4.GemmConfig): forced configurations against the torch reference.
SPLIT_CASES = [
    # rows, in (K), out (N), group, config: the comment says what the case covers
    (1, 160, 72, 32, int4.GemmConfig(16, 64, 32, split_k=2)),  # 5 groups in 2 splits: 3 + 2 (K not a multiple)
    (5, 320, 40, 64, int4.GemmConfig(16, 32, 16, split_k=3)),  # 5 groups in 3 splits: 2 + 2 + 1; 4 K tiles a group
    (37, 112, 24, 16, int4.GemmConfig(16, 16, 16, split_k=3)),  # 37 rows: 3 M tiles, the last partial; 3 + 3 + 1
    (20, 192, 136, 48, int4.GemmConfig(32, 64, 16, split_k=100)),  # more splits asked than groups: one each
    (3, 160, 72, 32, int4.GemmConfig(16, 32, 32, split_k=2, interleave=True)),  # each word loaded once, widened
    (17, 256, 200, 64, int4.GemmConfig(16, 64, 64, split_k=3, interleave=True)),  # partial N tile, interleaved
    (37, 128, 72, 64, int4.GemmConfig(32, 64, 32, split_k=1, interleave=True)),  # interleaved, no split
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "in_features", "out_features", "group", "config"), SPLIT_CASES)
def test_split_k_and_forced_configs_match_torch(device: str, rows: int, in_features: int, out_features: int,
                                                 group: int, config: int4.GemmConfig) -> None:  # fmt: skip
    _device(device)
    generator = torch.Generator().manual_seed(rows + in_features)
    qweight, qzeros, scales = int4.quantize(torch.randn(out_features, in_features, generator=generator), group)
    x = torch.randn(rows, in_features, generator=generator)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        xs, qw, qz, sc = (t.to(device) for t in (x.to(dtype), qweight, qzeros, scales))
        actual = int4.matmul_triton(xs, qw, qz, sc, group, config)
        expected = xs.float() @ int4.dequantize(qw, qz, sc, group, dtype).float()
        assert actual.dtype == dtype and actual.shape == (rows, out_features)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(actual.float(), expected, rtol=tolerance, atol=tolerance * 10)
        # The partials are added in a fixed order: the same launch gives the same bits.
        assert torch.equal(int4.matmul_triton(xs, qw, qz, sc, group, config), actual)


def test_split_plan_cuts_k_into_runs_of_whole_groups() -> None:
    # (K, group, asked) -> (K rows a split, splits): every split but the last of one length, none empty.
    assert int4.split_plan(4096, 128, 1) == (4096, 1)
    assert int4.split_plan(4096, 128, 6) == (768, 6)  # 32 groups: 6 + 6 + 6 + 6 + 6 + 2
    assert int4.split_plan(160, 32, 2) == (96, 2)
    assert int4.split_plan(320, 64, 3) == (128, 3)
    assert int4.split_plan(256, 64, 3) == (128, 2)  # 4 groups asked into 3 runs: 2 + 2 is as even
    assert int4.split_plan(192, 48, 100) == (48, 4)  # never more splits than groups
    for K, group, asked in [(14336, 128, 9), (112, 16, 3), (4096, 128, 11)]:
        k_split, splits = int4.split_plan(K, group, asked)
        assert k_split % group == 0 and splits <= asked
        assert (splits - 1) * k_split < K <= splits * k_split, "the last split holds at least one group"


def test_the_default_configs_split_decode_and_not_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    # An H100's 132 SMs: decode at the 8B shape's q/k/v (4096 -> 6144, group 128) splits K to fill them.
    monkeypatch.setattr(int4, "sm_count", lambda device: 132)
    decode = int4.gemm_config(1, 6144, 4096, 128, torch.device("cuda"))
    assert (decode.block_m, decode.block_k) == (16, 128) and decode.split_k > 1
    tiles = 6144 // decode.block_n * int4.split_plan(4096, 128, decode.split_k)[1]
    assert tiles >= int4.PROGRAMS_PER_SM * 132
    prefill = int4.gemm_config(2048, 6144, 4096, 128, torch.device("cuda"))
    assert prefill.split_k == 1 and prefill.block_m == 128 and prefill.num_warps == 8
    for rows in (1, 16, 17, 64, 200, 4096):
        for group in (16, 48, 64, 96, 128, 256):
            int4.check_config(int4.gemm_config(rows, 1024, group * 8, group, torch.device("cuda")), group)


def test_the_kernel_refuses_configs_it_cannot_run() -> None:
    qweight, qzeros, scales = int4.quantize(torch.randn(16, 96), 48)
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="block_k must divide the group size 48.*16 would do"):
        int4.matmul_triton(x, qweight, qzeros, scales, 48, int4.GemmConfig(16, 16, 32))
    with pytest.raises(ValueError, match="powers of two"):
        int4.matmul_triton(x, qweight, qzeros, scales, 48, int4.GemmConfig(16, 24, 16))
    with pytest.raises(ValueError, match="must be positive"):
        int4.matmul_triton(x, qweight, qzeros, scales, 48, int4.GemmConfig(16, 16, 16, split_k=0))
