"""What the native engine's warm-up (warmup.py, run on CUDA before a worker is ready) puts through
its steps, checked here on the CPU, where the same requests make the same steps."""

from worker.config_loader import load_config
from worker.engines.native.engine import NativeEngine


async def test_the_warm_up_takes_logits_in_each_of_few_rows_tiles(tiny_llama):
    """Outside the graphs the LM head's rows go to few_rows' kernel, in a tile of 16, 32 or 64 rows
    (BM, a variant Triton compiles at its first use): the warm-up takes logits of rows in each, or
    a fresh worker compiles the missing one in service. On an H200 (SmolLM2, the warm-up without a
    step of 17-31 such rows) a first burst of 64 prompts compiled one on the engine thread, ~0.35 s
    with every stream waiting; with it, bursts of 17, 20, 24, 30 and 64 compiled nothing."""
    from worker.engines.native.warmup import warm_up

    engine = NativeEngine(load_config(None, {"HOME": "/tmp"}, {
        "engine.name": "native", "engine.model": str(tiny_llama), "engine.dtype": "float32"}))
    await engine.load_model()
    logits_rows = []
    launch = engine._launch

    def recording(scheduled):
        logits_rows.append(sum(1 for seq, count in scheduled
                               if not seq.draft and seq.num_cached + count == len(seq.tokens)))
        return launch(scheduled)

    engine._launch = recording
    try:
        await warm_up(engine)
        tiles = {16 if rows <= 16 else 32 if rows <= 32 else 64 for rows in logits_rows if 1 < rows <= 64}
        assert tiles == {16, 32, 64}, sorted(set(logits_rows))
        assert engine.num_unfinished() == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        await engine.unload_model()
