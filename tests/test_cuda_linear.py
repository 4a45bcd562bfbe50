"""The native engine's linear products on CUDA (these tests skip without a CUDA GPU, but for the
choice of config): gemv's one-row kernel and few_rows' kernel against torch's linear, with the norm,
the rotary embedding or the gate/up activation inside, and which products take which kernel.
What passes between a product and the norm after it: test_cuda_residual.py."""

import itertools

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton matrix-vector kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_linear_matches_torch(dtype):
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    for n, k, bias in ((3072, 2048, False), (1001, 576, True), (4, 8192, False)):  # even and uneven tiles, a bias
        linear = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(RowLinear(linear)(x), linear(x), **tolerance)
        for rows in (3, 16, 40):  # few rows through few_rows (half precision, with PDL; 40 on an H200), more through torch
            torch.testing.assert_close(RowLinear(linear)(x.repeat(rows, 1)), linear(x.repeat(rows, 1)), **tolerance)


def test_the_one_row_kernel_takes_its_devices_config_for_the_widths_measured(monkeypatch):
    """gemv.ROW_CONFIGS by a part of the device's name, the first entry whose K range takes the
    product's K; other devices and other widths take the kernel's own config (None). few_rows'
    narrow products likewise (few_rows.FEW_ROWS_NARROW), the rotary embedding inside the one-row
    kernel (gemv.ROPE_INSIDE), and which gate/up projections give their activation from few_rows'.
    Runs on the CPU."""
    from worker.engines.native import few_rows, gemv
    from worker.engines.native.linear import RowLinear

    h200, h100, a100 = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)
    names = {h200: "NVIDIA H200", h100: "NVIDIA H100 80GB HBM3", a100: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[device])
    monkeypatch.setattr(gemv, "_NAMES", {})
    for narrowest, widest, config in gemv.ROW_CONFIGS["H200"]:
        assert gemv.row_config(h200, narrowest) == gemv.row_config(h200, widest) == config
    assert gemv.row_config(h200, 576) == gemv.ROW_CONFIGS["H200"][0][2]
    assert gemv.row_config(h200, 8192) is None and gemv.row_config(a100, 576) is None  # the 1B's down projection
    ((narrowest, _, config),) = gemv.ROW_CONFIGS["H100"]
    assert gemv.row_config(h100, narrowest) == gemv.row_config(h100, 14336) == config
    assert gemv.row_config(h100, narrowest - 1) is None and gemv.row_config(h100, 576) is None
    # few_rows: the narrow products' own config on an H200
    widest, most, narrow = few_rows.FEW_ROWS_NARROW["H200"]
    assert few_rows.few_rows_config(h200, widest, 2048, most) == few_rows.few_rows_config(h200, 576, 2048, 2) == narrow
    assert (few_rows.few_rows_config(h200, widest + 1, 2048, 2) == few_rows.few_rows_config(h200, widest, 2048, most + 1)
            == few_rows.few_rows_config(h100, widest, 2048, 2) == few_rows.FEW_ROWS)
    assert (few_rows.few_rows_config(h200, 16384, 2048, 2) == few_rows.few_rows_config(a100, 16384, 2048, 2)
            == few_rows.FEW_ROWS_WIDE)
    # past FEW_ROWS_MOST rows: the H200's products up to its K, by their row count; cuBLAS elsewhere
    deepest, ((most, narrow, wide), (most_of_all, _, wide_of_all)) = few_rows.FEW_ROWS_MANY["H200"]
    many = few_rows.FEW_ROWS_MOST + 1
    assert few_rows.few_rows_config(h200, 3072, deepest, many) == few_rows.few_rows_config(h200, 8191, 2048, most) == narrow
    assert few_rows.few_rows_config(h200, 8192, 2048, most) == few_rows.few_rows_config(h200, 65535, 2048, many) == wide
    assert (few_rows.few_rows_config(h200, 16384, 2048, most + 1) == few_rows.few_rows_config(h200, 16384, 2048, most_of_all)
            == wide_of_all)
    assert all(few_rows.few_rows_config(device, n, k, m) is None for device, n, k, m in (
        (h200, 3072, deepest + 256, many), (h200, 65536, 2048, many), (h200, 3072, 2048, most_of_all + 1),
        (h100, 3072, 2048, many), (a100, 3072, 2048, many)))
    # the rotary embedding inside a one-row qkv projection: the H200's up to its K, no other device's
    deepest = gemv.ROPE_INSIDE["H200"]
    assert gemv.rope_inside(h200, deepest) and gemv.rope_inside(h200, 576)
    assert not any(gemv.rope_inside(device, k) for device, k in ((h200, deepest + 1), (h100, 576), (a100, 576)))
    # deeper than the H200's deepest K: cuBLAS at any row count; other devices keep few_rows
    deepest = few_rows.FEW_ROWS_DEEPEST["H200"]
    assert few_rows.few_rows_config(h200, 4096, deepest + 256, 2) is None
    assert (few_rows.few_rows_config(h200, 2048, deepest, 16) == few_rows.few_rows_config(h100, 4096, deepest + 256, 2)
            == few_rows.FEW_ROWS)
    # K not of 256s: the config's K tile halved until it divides K (SmolLM2's 576: 64); K not of 64s: cuBLAS
    bn, _, warps, stages = few_rows.FEW_ROWS
    assert few_rows.few_rows_config(h200, 960, 576, 16) == few_rows.few_rows_config(h100, 960, 576, 2) == (bn, 64, warps, stages)
    assert few_rows.few_rows_config(h200, 960, 640, 16) == (bn, 128, warps, stages)
    assert few_rows.few_rows_config(h200, 3072, 576, most) == (*narrow[:1], 64, *narrow[2:])  # past FEW_ROWS_MOST
    assert few_rows.few_rows_config(h200, 960, 1000, 16) is None and few_rows.few_rows_config(h200, 960, 544, 2) is None
    # split along K (the o and down projections past HANDOFF_MOST_ROWS, and the Llama-1B shape's
    # down projection, which hands nothing on, at 2-16 rows too): the H200's, by rows, N and K
    many, most = few_rows.HANDOFF_MOST_ROWS + 1, few_rows.FEW_ROWS_LIMIT
    ((*_, small), (*_, deep), (*_, deep_few)) = few_rows.FEW_ROWS_SPLIT["H200"]
    assert few_rows.split_config(h200, 2048, 2048, many) == few_rows.split_config(h200, 2048, 1024, most) == small
    assert few_rows.split_config(h200, 2048, 8192, many) == few_rows.split_config(h200, 2048, 2560, most) == deep
    assert few_rows.split_config(h200, 2048, 8192, 2) == few_rows.split_config(h200, 2048, 8192, 16) == deep_few
    assert few_rows.split_config(h200, 2048, 2304, many) == (*deep[:1], 64, *deep[2:])  # bk halved: 4 x 64 | 2,304
    assert all(few_rows.split_config(device, n, k, m) is None for device, n, k, m in (
        (h200, 2048, 2048, many - 1), (h200, 2048, 2048, 16), (h200, 2048, 4096, 16), (h200, 2048, 2048, most + 1),
        (h100, 2048, 2048, many),
        (h200, 2048, 8192, 1), (h200, 2048, 8192, 17), (h200, 2048, 8192, many - 1), (h100, 2048, 8192, 16),
        (h200, 2048, 2112, many),  # K in no two parts of whole 64-wide tiles
        (h200, 4096, 4096, many), (h200, 4096, 14336, 16),  # the Llama-8B shape's (N 4,096)
        (h200, 576, 1536, many), (h200, 576, 1536, 16)))  # SmolLM2's (576)
    # the activation from few_rows' kernel where the down projection after it does not run whole there
    llama_1b, smollm2, uneven = (RowLinear(torch.nn.Linear(k, 2 * n, bias=False, device="meta"))
                                 for k, n in ((2048, 8192), (576, 1536), (576, 1000)))
    assert all(llama_1b.gives_activation(h200, rows) for rows in (2, 16, 17, 64))
    assert uneven.gives_activation(h200, 2)  # a down projection of K 1,000 no few_rows kernel takes
    assert not any(smollm2.gives_activation(h200, rows) for rows in (2, 16, 17, 64))
    assert not llama_1b.gives_activation(h100, 16) and llama_1b.gives_activation(h100, 17)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_up_projection_gives_its_activation_to_the_bit(dtype):
    """A gate/up projection's SiLU-and-multiply inside its kernel (one row's gemv, with the norm
    before it or not, and few_rows) gives what the product then the SiLU kernel give, to the bit;
    rows no kernel here takes get the two kernels."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.few_rows import few_rows
    from worker.engines.native.gemv import gemv, gemv_after_norm
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    for n, k in ((2 * 8192, 2048), (2 * 1536, 576)):  # the Llama-1B shape's and SmolLM2's
        gate_up = RowLinear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype))
        x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
        assert torch.equal(gemv(x, gate_up.linear.weight, None, gated=True), ops.silu_and_mul(gate_up(x)))
        norm = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        total, activation = gate_up.after_add_rms_norm(x, residual, norm, 1e-5, gated=True)
        assert activation.shape == (1, n // 2)
        assert torch.equal(activation, ops.silu_and_mul(gemv_after_norm(x, residual, norm, 1e-5, gate_up.linear.weight,
                                                                        None)[1]))
        for rows in (2, 16, 17, 40, 65):  # few_rows where it gives the activation (on an H200), then torch
            many = torch.randn(rows, k, device="cuda", dtype=dtype)
            assert torch.equal(gate_up.activated(many, ops.silu_and_mul), ops.silu_and_mul(gate_up(many)))
    if dtype == torch.bfloat16:  # few_rows' own shapes: uneven N, a bias, every row count up to its tile
        linear = torch.nn.Linear(512, 1001, device="cuda", dtype=dtype)
        paired = torch.nn.Linear(512, 2 * 501, device="cuda", dtype=dtype)
        narrow = (16, 256, 4, 5)  # few_rows.FEW_ROWS_NARROW's, for up to 8 rows
        many = [(17, (32, 256, 4, 4)), (32, (128, 128, 4, 4)), (33, (32, 128, 4, 4)), (64, (64, 64, 4, 4))]
        for rows, config in [*itertools.product((2, 7, 16, 33), [(32, 256, 4, 3)]), (2, narrow), (7, narrow), *many]:
            x = torch.randn(rows, 512, device="cuda", dtype=dtype)
            torch.testing.assert_close(few_rows(x, linear.weight, linear.bias, *config), linear(x),
                                       atol=2e-2, rtol=2e-2)
            assert torch.equal(few_rows(x, paired.weight, paired.bias, *config, gated=True),
                               ops.silu_and_mul(few_rows(x, paired.weight, paired.bias, *config)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_takes_the_norm_before_it_as_it_reads_its_row(dtype):
    """One row's residual add and RMS norm inside the next projection's kernel: the residual stream
    to the bit, the projection as the norm kernel and the projection give it (the sum of squares
    adds up in another order)."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    for n, k in ((3072, 2048), (1001, 576)):  # SmolLM2's width: a row that is not a power of two
        linear = RowLinear(torch.nn.Linear(k, n, bias=n == 1001, device="cuda", dtype=dtype))
        x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
        weight = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        total, out = linear.after_add_rms_norm(x, residual, weight, 1e-5)
        want_total, h = ops.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(total, want_total)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out, linear(h), **tolerance)
        assert linear.after_add_rms_norm(x.repeat(2, 1), residual.repeat(2, 1), weight, 1e-5) is None  # rows: two kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_qkv_projection_rotates_and_writes_the_cache_as_the_rope_kernel_does(dtype):
    """One row's qkv projection with the rotary embedding and cache write inside (after the norm, and
    without it as a first layer's): the bits of the projection, then the rope-and-store kernel."""
    from worker.engines.native.linear import RowLinear
    from worker.engines.native.rotary import Rope, rope_and_store

    torch.manual_seed(0)
    for heads, kv_heads, k, bias in ((32, 8, 2048, False), (9, 3, 576, True)):  # Llama-1B's and SmolLM2's heads
        dim, slot = 64, 37
        linear = RowLinear(torch.nn.Linear(k, (heads + 2 * kv_heads) * dim, bias=bias, device="cuda", dtype=dtype))
        x, residual = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
        weight = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        angles = (slot * torch.rand(1, 1, dim // 2, device="cuda")).repeat(1, 1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        slots = torch.tensor([slot], device="cuda")
        for normed in (True, False):
            caches = [torch.zeros(64, kv_heads, dim, device="cuda", dtype=dtype) for _ in range(4)]
            rope = Rope(cos, sin, slots, caches[0], caches[1], heads * dim, kv_heads * dim)
            if normed:
                total, got = linear.after_add_rms_norm(x, residual, weight, 1e-5, rope)
                want_total, qkv = linear.after_add_rms_norm(x, residual, weight, 1e-5)
                assert torch.equal(total, want_total)
            else:
                got, qkv = linear.rotating(x, rope), linear(x)
            q, k_new, v = (part.reshape(1, -1, dim) for part in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
            want_q, want_k = rope_and_store(q, k_new, v, cos, sin, caches[2], caches[3], slots, None)
            want = torch.cat((want_q.reshape(1, -1), want_k.reshape(1, -1), v.reshape(1, -1)), -1)
            if dtype == torch.float32:  # the two kernels' multiply-adds may fuse differently
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(caches[:2], caches[2:], atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
            assert torch.count_nonzero(caches[0].abs().sum((1, 2))) == 1  # the slot's row and no other
