"""few_rows' kernel in parts along K (few_rows.FEW_ROWS_SPLIT: the o and down projections whose
fp32 parts the norm kernel after them adds), run here on the CPU through Triton's interpreter, in a
process of its own (the interpreter is chosen when the kernels are defined), at the row counts the
H200 splits: 2-16 and 33-64. tests/test_cuda_residual.py runs it compiled on a GPU, with the norm."""

import pytest

from tests import interpreter

pytest.importorskip("triton")


@interpreter.only
def test_each_part_of_k_gives_its_own_fp32_product_the_bias_in_the_first():
    out = interpreter.interpreted("""
        import torch
        from worker.engines.native.few_rows import few_rows

        torch.manual_seed(0)
        n, k, parts = 192, 512, 4
        w = torch.randn(n, k, dtype=torch.float16)
        bias = torch.randn(n, dtype=torch.float16)
        for rows in (2, 16, 40):
            x = torch.randn(rows, k, dtype=torch.float16)
            out = few_rows(x, w, bias, 64, 64, 4, 4, parts=parts)
            step = k // parts
            want = torch.stack([x[:, i * step:(i + 1) * step].float() @ w[:, i * step:(i + 1) * step].float().T
                                for i in range(parts)])
            want[0] += bias.float()
            assert out.shape == (parts, rows, n) and out.dtype == torch.float32
            torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-4)
        print("ok")
    """)
    assert out.strip() == "ok"
