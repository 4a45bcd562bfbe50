"""The native engine's linear products on CUDA (these tests skip without a CUDA GPU, but for the
choice of config): gemv's one-row kernel and few_rows' kernel against torch's linear, with the norm,
the rotary embedding or the gate/up activation inside, and which products take which kernel."""

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
    # split along K (the o and down projections past HANDOFF_MOST_ROWS): the H200's, by N and K
    many, most = few_rows.HANDOFF_MOST_ROWS + 1, few_rows.FEW_ROWS_LIMIT
    ((_, _, _, small), (_, _, _, deep)) = few_rows.FEW_ROWS_SPLIT["H200"]
    assert few_rows.split_config(h200, 2048, 2048, many) == few_rows.split_config(h200, 2048, 1024, most) == small
    assert few_rows.split_config(h200, 2048, 8192, many) == few_rows.split_config(h200, 2048, 2560, most) == deep
    assert few_rows.split_config(h200, 2048, 2304, many) == (*deep[:1], 64, *deep[2:])  # bk halved: 4 x 64 | 2,304
    assert all(few_rows.split_config(device, n, k, m) is None for device, n, k, m in (
        (h200, 2048, 2048, many - 1), (h200, 2048, 2048, most + 1), (h100, 2048, 2048, many),
        (h200, 2048, 2112, many),  # K in no two parts of whole 64-wide tiles
        (h200, 4096, 4096, many), (h200, 576, 1536, many)))  # the Llama-8B shape's (N 4,096), SmolLM2's (576)
    # the activation from few_rows' kernel where the down projection after it goes to cuBLAS
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_few_rows_adds_the_residual_stream_and_the_next_product_takes_its_norm():
    """A product of a few rows gives the residual stream's next value (RowLinear.adding: the bits of
    the norm kernel's add), its rows' sums of squares in parts and the sum times the next norm's
    weight; the next product's kernel takes the norm from them (RowLinear.after_norm), as the norm
    kernel and the product give it but for rounding; a gate/up projection's activation likewise.
    One row, more than HANDOFF_MOST_ROWS, or no weight given: None, the norm kernel then adds."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.few_rows import HANDOFF_MOST_ROWS, few_rows_config
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    dtype = torch.bfloat16
    # qkv, an uneven N with a bias, gate/up: the Llama-1B shape's width, and SmolLM2's (K 576, in tiles of 64)
    for width, products in ((2048, ((3072, False), (1001, True), (2 * 8192, False))),
                            (576, ((960, True), (2 * 1536, False)))):
        o = RowLinear(torch.nn.Linear(width, width, bias=False, device="cuda", dtype=dtype))
        for n, bias in products:
            linear = RowLinear(torch.nn.Linear(width, n, bias=bias, device="cuda", dtype=dtype))
            norm = torch.rand(width, device="cuda", dtype=dtype) + 0.5
            for rows in (2, 8, 16, 17, 32, 40):
                x, residual = (torch.randn(rows, width, device="cuda", dtype=dtype) for _ in range(2))
                summed = o.adding(x, residual, norm)
                if summed is None:  # rows few_rows does not take on this device, or past HANDOFF_MOST_ROWS
                    assert rows > HANDOFF_MOST_ROWS or few_rows_config(x.device, width, width, rows) is None
                    continue
                want_total, h = ops.add_rms_norm(o(x), residual, norm, 1e-5)
                assert torch.equal(summed.total, want_total) and summed.norm is norm
                assert torch.equal(summed.weighted, (want_total.float() * norm.float()).to(dtype))
                torch.testing.assert_close(summed.squares.sum(0), (want_total.float() ** 2).sum(1), rtol=1e-5, atol=0)
                torch.testing.assert_close(linear.after_norm(summed, 1e-5), linear(h), atol=3e-2, rtol=2e-2)
                if n in (2 * 8192, 2 * 1536):  # the activation: the kernel's own where it gives it, else the SiLU kernel's
                    got = linear.after_norm(summed, 1e-5, ops.silu_and_mul)
                    assert torch.equal(got, ops.silu_and_mul(linear.after_norm(summed, 1e-5)))
                unweighted = o.adding(x, residual)
                assert torch.equal(unweighted.total, want_total) and linear.after_norm(unweighted, 1e-5) is None
    x = torch.randn(HANDOFF_MOST_ROWS + 1, width, device="cuda", dtype=dtype)
    assert o.adding(x[:1], x[:1], norm) is None and o.adding(x, x, norm) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_a_product_split_along_k_gives_the_norm_its_parts():
    """Past HANDOFF_MOST_ROWS rows, an o or down projection split along K (few_rows.FEW_ROWS_SPLIT)
    gives its fp32 parts, and the norm kernel adds them up, rounds the sum as few_rows rounds a
    product and adds the residual stream: to the bit what the norm kernel gives on that rounded sum.
    Where the device has no split (its name, the row count), RowLinear.split gives None."""
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.few_rows import split_config
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    dtype, device = torch.bfloat16, torch.device("cuda")
    for n, k, bias in ((2048, 2048, False), (2048, 8192, True), (4096, 4096, False)):
        linear = RowLinear(torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=dtype))
        norm = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        for rows in (32, 33, 40, 64, 65):
            x, residual = (torch.randn(rows, width, device="cuda", dtype=dtype) for width in (k, n))
            split = linear.split(x, residual)
            config = split_config(device, n, k, rows)
            if config is None:
                assert split is None
                continue
            parts = split.parts
            assert parts.shape == (config[4], rows, n) and parts.dtype == torch.float32
            want = x.float() @ linear.linear.weight.float().T + (linear.linear.bias.float() if bias else 0)
            torch.testing.assert_close(parts.sum(0), want, atol=1e-3, rtol=1e-3)
            total, h = ops.add_rms_norm(parts, residual, norm, 1e-5)
            summed = parts[0] + parts[1] if len(parts) == 2 else parts.sum(0)
            want_total, want_h = ops.add_rms_norm(summed.to(dtype), residual, norm, 1e-5)
            if len(parts) == 2:  # one order of adding: the same bits
                assert torch.equal(total, want_total) and torch.equal(h, want_h)
            torch.testing.assert_close(total, want_total, atol=2e-2, rtol=1e-2)
    if "H200" in torch.cuda.get_device_name():
        assert split_config(device, 2048, 2048, 40) is not None  # what the loop above covered


def _model_step(model, caches: torch.Tensor, contexts: list[int], queries: list[int], block_size: int = 16):
    """(logits, k cache, v cache) of one step through the model: each sequence's last `queries`
    tokens of its `contexts`, over copies of the caches (2, layers, slots, kv heads, head dim)."""
    from worker.engines.native.batch import Batch

    tables = [[13 * i + j for j in range(13)] for i in range(len(contexts))]
    positions = [p for n, q in zip(contexts, queries) for p in range(n - q, n)]
    rows = [i for i, q in enumerate(queries) for _ in range(q)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in zip(rows, positions)]
    ends = torch.tensor(queries).cumsum(0) - 1
    batch = Batch(torch.tensor([(7 * p + 3) % 500 for p in positions], device="cuda"),
                  torch.tensor(positions, device="cuda"), torch.tensor(slots, device="cuda"), queries, contexts,
                  tables, ends.cuda(), block_size)
    k, v = caches.clone()
    return model(batch, k, v), k, v


def _caches(model, blocks: int = 64, block_size: int = 16) -> torch.Tensor:
    """Random caches for _model_step, whose sequence i holds blocks 13 * i to 13 * i + 12."""
    c = model.config
    torch.manual_seed(6)
    return torch.randn(2, c.num_layers, blocks * block_size, c.num_kv_heads, c.head_dim).to("cuda", torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_a_model_of_few_rows_hands_the_residual_stream_from_kernel_to_kernel(tiny_llama, monkeypatch):
    """A step of a few rows through the model (decodes alone, and a prompt beside them) has its o and
    down projections add the residual stream and the next projections (qkv, gate/up) take the norm:
    the logits and cache writes of the norm kernels' path, but for rounding."""
    from worker.engines.native.linear import RowLinear
    from worker.engines.native.model import load_model

    model = load_model(tiny_llama, torch.bfloat16, torch.device("cuda"))
    c, caches = model.config, _caches(model)
    adding, after_norm, added, normed = RowLinear.adding, RowLinear.after_norm, [], []

    def spy(self, x, residual, next_norm=None):
        summed = adding(self, x, residual, next_norm)
        added.append(summed is not None)
        return summed

    def spy_norm(self, x, eps, silu_and_mul=None):
        out = after_norm(self, x, eps, silu_and_mul)
        normed.append(out is not None)
        return out

    for contexts, queries in (([30, 17, 90, 5], [1] * 4), ([30, 17, 90, 5, 40], [1, 1, 1, 1, 9])):
        monkeypatch.setattr(RowLinear, "adding", spy)
        monkeypatch.setattr(RowLinear, "after_norm", spy_norm)
        added.clear()
        normed.clear()
        got = _model_step(model, caches, contexts, queries)
        assert added == [True] * (2 * c.num_layers)
        assert normed == [True] * (2 * c.num_layers - 1)  # qkv past the first layer, every gate/up
        monkeypatch.setattr(RowLinear, "adding", lambda self, x, residual, next_norm=None: None)
        want = _model_step(model, caches, contexts, queries)
        assert got[0].shape == (len(contexts), c.vocab_size)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_a_model_step_past_the_hand_off_splits_its_products_for_the_norms(tiny_model, monkeypatch):
    """Past HANDOFF_MOST_ROWS rows (decodes alone, and a prompt beside them, whose last rows the
    model picks from the parts), the o and down projections give their parts along K to the norm
    after them where the device splits them (few_rows.FEW_ROWS_SPLIT; the Llama-1B shape's widths):
    the logits and cache writes of the whole products' path, but for rounding."""
    from worker.engines.native.few_rows import split_config
    from worker.engines.native.linear import RowLinear
    from worker.engines.native.model import load_model

    folder = tiny_model("llama", hidden_size=2048, intermediate_size=2048, num_attention_heads=32,
                        num_key_value_heads=8)
    model = load_model(folder, torch.bfloat16, torch.device("cuda"))
    contexts = [20 + 3 * i for i in range(36)]
    c, caches = model.config, _caches(model, 13 * len(contexts))
    splits = split_config(torch.device("cuda"), c.hidden_size, c.hidden_size, 40) is not None
    assert splits == (split_config(torch.device("cuda"), c.hidden_size, c.intermediate_size, 40) is not None)
    split, made = RowLinear.split, []

    def spy(self, x, residual):
        parts = split(self, x, residual)
        made.append(parts is not None)
        return parts

    for queries in ([1] * 36, [1] * 35 + [9]):
        monkeypatch.setattr(RowLinear, "split", spy)
        made.clear()
        got = _model_step(model, caches, contexts, queries)
        assert made == [splits] * (2 * c.num_layers)
        monkeypatch.setattr(RowLinear, "split", lambda self, x, residual: None)
        want = _model_step(model, caches, contexts, queries)
        assert got[0].shape == (len(contexts), c.vocab_size)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
    if "H200" in torch.cuda.get_device_name():
        assert splits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS and the Triton norm kernel run on CUDA")
def test_cublas_in_parts_along_k_gives_the_norm_its_parts(monkeypatch):
    """Past few_rows' rows, an o or down projection that cuBLAS runs faster in parts along K (blas.parts)
    gives their fp32 products (blas.split), which add up to the product; the norm kernel adds them as
    it adds few_rows' parts. The choice: the fastest of the ways timed with the norm kernel after
    them, kept only MARGIN ahead of the whole product, made while tuning and for half precision,
    no bias, contiguous rows and a contiguous weight alone."""
    from worker.engines.native import blas
    from worker.engines.native.elementwise import Elementwise
    from worker.engines.native.linear import RowLinear

    torch.manual_seed(0)
    ops = Elementwise()
    ops.use_triton()
    dtype = torch.bfloat16
    timings: list[float] = []  # what device_ms gives, call by call
    monkeypatch.setattr(blas, "device_ms", lambda run, before: timings.pop(0))
    monkeypatch.setattr(blas, "_faster", lambda layer, x: blas.LIBRARIES[0])  # the whole product's front end
    for n, k, rows in ((2048, 8192, 256), (576, 1536, 80)):
        x, residual = (torch.randn(rows, width, device="cuda", dtype=dtype) for width in (k, n))
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
        norm = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        for count in blas.SPLITS:
            parts = blas.split(linear.weight, x, count)
            assert parts.shape == (count, rows, n) and parts.dtype == torch.float32
            torch.testing.assert_close(parts.sum(0), x.float() @ linear.weight.float().T, atol=2e-3, rtol=1e-3)
            total, h = ops.add_rms_norm(parts, residual, norm, 1e-5)
            want_total, want_h = ops.add_rms_norm(parts.sum(0).to(dtype), residual, norm, 1e-5)
            torch.testing.assert_close(total, want_total, atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(h, want_h, atol=3e-2, rtol=2e-2)
            if count == 2:  # one order of adding: the same bits
                assert torch.equal(total, (parts[0] + parts[1]).to(dtype).float().add(residual.float()).to(dtype))
        monkeypatch.setattr(blas, "_PARTS", {})
        for times, want in (((1.0, 0.9, 0.5), 4), ((1.0, 0.9, 0.95), 2), ((1.0, 0.98, 0.99), 1), ((0.5, 0.9, 0.6), 1)):
            timings[:] = times * blas.ROUNDS
            blas._PARTS.clear()
            assert blas.parts(linear, x, residual) == 1  # not tuning: no choice made, the whole product
            with blas.tuning():
                assert blas.parts(linear, x, residual) == want
            assert blas.parts(linear, x, residual) == want  # as chosen, for that row count
            split = RowLinear(linear).split(x, residual)
            assert (split is None) if want == 1 else split.parts.shape == (want, rows, n)
        timings[:] = (1.0, 0.5, 0.5) * blas.ROUNDS * 4
        blas._PARTS.update({(x.device, dtype, rows, n, k): 4, (x.device, torch.float32, rows, n, k): 4})
        with blas.tuning():  # never split, whatever its shape's choice: fp32, a bias, x or W not contiguous
            assert blas.parts(linear.float(), x.float(), residual.float()) == 1
            assert blas.parts(torch.nn.Linear(k, n, device="cuda", dtype=dtype), x, residual) == 1
            assert blas.parts(linear.to(dtype), x.t().contiguous().t(), residual) == 1
            strided = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
            strided.weight = torch.nn.Parameter(torch.empty(k, n, device="cuda", dtype=dtype).t())
            assert blas.parts(strided, x, residual) == 1
        assert len(timings) == 3 * blas.ROUNDS * 4  # none of them timed
    assert RowLinear(linear).split(x[:64], residual[:64]) is None  # few_rows' rows: its own split or none


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_a_model_step_past_few_rows_adds_cublas_parts_in_the_norms(tiny_model, monkeypatch):
    """Past few_rows' rows (decodes alone, and a prompt beside them, whose last rows the model picks
    from the parts), the o and down projections that cuBLAS runs in parts along K (blas.parts) give
    them to the norm after them: the logits and cache writes of the whole products' path, but for
    rounding."""
    from worker.engines.native import blas
    from worker.engines.native.linear import RowLinear
    from worker.engines.native.model import load_model

    folder = tiny_model("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                        num_key_value_heads=2)
    model = load_model(folder, torch.bfloat16, torch.device("cuda"))
    contexts = [20 + i for i in range(72)]
    c, caches = model.config, _caches(model, 13 * len(contexts))
    split, made = RowLinear.split, []

    def spy(self, x, residual):
        parts = split(self, x, residual)
        made.append(None if parts is None else parts.parts.shape[0])
        return parts

    monkeypatch.setattr(RowLinear, "split", spy)
    for queries in ([1] * 72, [1] * 71 + [9]):
        monkeypatch.setattr(blas, "parts", lambda layer, x, residual: 2)
        made.clear()
        got = _model_step(model, caches, contexts, queries)
        assert made == [2] * (2 * c.num_layers)
        monkeypatch.setattr(blas, "parts", lambda layer, x, residual: 1)
        made.clear()
        want = _model_step(model, caches, contexts, queries)
        assert made == [None] * (2 * c.num_layers)
        assert got[0].shape == (len(contexts), c.vocab_size)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
