"""The residual stream between a product and the norm after it on CUDA (these tests skip without a
CUDA GPU): handed from few_rows' kernel to the next product's (RowLinear.adding / after_norm), and
products in parts along K, few_rows' or cuBLAS's (RowLinear.split, blas.parts), that the norm kernel
adds; product by product and through a model step. The products themselves: test_cuda_linear.py."""

import pytest
import torch


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
    """An o or down projection split along K (few_rows.FEW_ROWS_SPLIT: past HANDOFF_MOST_ROWS rows,
    and from 2 rows where it hands nothing on, as the Llama-1B shape's down projection) gives its
    fp32 parts, and the norm kernel adds them up, rounds the sum as few_rows rounds a product and
    adds the residual stream: to the bit what the norm kernel gives on that rounded sum. Where the
    device has no split (its name, the row count), RowLinear.split gives None."""
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
        for rows in (2, 16, 17, 32, 33, 40, 64, 65):
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
    if "H200" in torch.cuda.get_device_name():  # what the loop above covered
        assert split_config(device, 2048, 2048, 40) is not None and split_config(device, 2048, 8192, 16) is not None


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
