"""native engine: continuous batching over a paged KV cache, on one engine thread.

Each step reads as schedule() -> launch() -> read() -> emit(): the Batcher (batcher.py) picks the
step's rows, running sequences decoding one token each and waiting ones prefilling in chunks, and
preempts the newest running sequence when blocks run out. launch() queues the forward pass and the
sampling on the device; read() waits for the tokens. On CUDA a step's tokens become text and
messages (emit) while the next step runs, and a decode step whose successor is known before its
tokens are has that successor launched first, fed with its tokens on the device (ahead.py).
"""

from __future__ import annotations

import itertools
import os
import time

import torch

from worker.config import ConfigError
from worker.engines.base import ENDING, ModelInfo, RequestStream
from worker.engines.detokenizer import OutputText
from worker.engines.native import kernels as cpu_kernels
from worker.engines.native.kernels import keep_compiled
from worker.engines.native.ahead import launch as launch_ahead
from worker.engines.native.batcher import Batcher
from worker.engines.cache_events import CacheEvents
from worker.engines.native.block_manager import BlockManager, zeros
from worker.engines.native.messages import Messages
from worker.engines.native.model import load_model
from worker.engines.native.pacer import PrefillPacer
from worker.engines.native.sequence import DecodeRows, Sequence, Step, batch_of, kept_rows, pick
from worker.engines.native.speculation import Settings, Speculator
from worker.engines.native.warmup import forget_warm_up, warm_up
from worker.engines.prompt import encode_prompt, load_tokenizer
from worker.engines.sampler import make_generator
from worker.engines.threaded import ThreadedEngine
from worker.errors import DeviceOutOfMemory
from worker.models import locate_model
from worker.request import GenerationRequest, RequestOutput
from worker.telemetry import get_logger

log = get_logger(__name__)
GIB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARGS = {"block_size": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 64, "gpu_memory_utilization": 0.9,
        "kv_cache_dtype": "auto", "enable_prefix_caching": True, "enforce_eager": False, "cpu_threads": 0,
        "overlap_output": "auto", "quantization": "none", "prefill_chunk_s": 0.25, "max_kv_blocks": 0,
        "speculation": "auto", "speculative_tokens": 8, "speculative_ngram_min": 2, "speculative_ngram_max": 4,
        "speculative_min_accepted": 0.5}


class NativeEngine(ThreadedEngine):
    name = "native"
    preset_args = ("block_size", "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization")
    paces_messages = True  # messages.py: a sleep a message in the servicer would only repeat it
    can_leave_text = True  # in its own process the worker makes the text (docs/architecture.md)
    warmup_prompt_tokens = 64  # so the PrefillPacer has a rate before the first long prompt

    def __init__(self, config, on_fatal=None):
        super().__init__(config, on_fatal)
        unknown = set(config.engine.args) - set(ARGS)
        if unknown:
            raise ConfigError(f"engine.args.{sorted(unknown)[0]}", f"the native engine takes {sorted(ARGS)}")
        self.args = {**ARGS, **config.engine.args}
        if self.args["kv_cache_dtype"] != "auto":
            raise ConfigError("engine.args.kv_cache_dtype", "the native engine keeps the KV cache in the model's dtype")
        self.quantization = str(self.args["quantization"]).lower()
        if self.quantization not in ("none", "int4"):
            raise ConfigError("engine.args.quantization", "none | int4 (weight-only, on CPU)")
        self.speculator = Speculator(Settings.from_args(self.args))
        self.speculates = self.speculator.settings.num_tokens > 0
        self._overlap_setting = str(self.args["overlap_output"]).lower()
        if self._overlap_setting not in ("auto", "true", "false"):
            raise ConfigError("engine.args.overlap_output", "auto (on for CUDA) | true | false")
        self.model = self.tokenizer = self.device = None
        self.blocks: BlockManager | None = None
        self.events = CacheEvents(int(self.args["block_size"]))
        self.batcher: Batcher | None = None  # made at load, with the blocks
        self._pending: list[tuple[Sequence, int]] = []  # (sequence, token) sampled and not yet emitted
        self._ends: list[RequestStream] = []  # whose last token a launched step makes: _emit posts .ending
        self.decode_rows = DecodeRows()  # prompt chunks that run as decode rows, set at load
        self.messages = Messages(config.server.max_messages_per_s, config.server.min_message_interval_s)

    def _load(self) -> None:
        engine = self.config.engine
        folder = locate_model(engine.model, self.config.models.cache_dir, log=lambda m: log.info(m))
        self.device = torch.device(engine.device if engine.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.speculator.settings.by_default is None:  # auto: measured to pay on CPUs, not yet on CUDA
            self.speculator.by_default = self.device.type == "cpu"
        if self.quantization == "int4" and self.device.type != "cpu":
            raise ConfigError("engine.args.quantization", f"int4 runs on CPU; the device is {self.device}")
        # int4: bf16 activations on every CPU; without oneDNN bf16, prompts run their GEMMs in fp32
        # (csrc/cpu_linear.cpp) and decode reads half fp32's KV bytes (AVX2: 187 tok/s against 168).
        dtype = DTYPES.get(engine.dtype) or (
            torch.bfloat16 if self.device.type == "cuda" or self.quantization == "int4" else torch.float32)
        kernels = cpu_kernels.load_configured(engine.kernel_dir, engine.cpu_isa) if self.device.type == "cpu" else None
        if self.device.type == "cuda":
            keep_compiled(engine.kernel_dir)  # Triton's kernels where the next start finds them
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(cores)  # packing the weights for oneDNN (CPU) takes most of the load
        try:
            self.model = load_model(folder, dtype, self.device, self.quantization, engine.max_model_len)
        except ValueError as exc:
            raise ConfigError("engine.model", str(exc)) from exc
        if self.device.type == "cpu":
            # Every core, the event loop thread's included: with the model loaded on this thread
            # too (threaded.py), 2 threads on 2 cores ran SmolLM2 at batch 8 at 182 tok/s in bf16
            # and 155 in fp32, against 135 and 109 with one.
            torch.set_num_threads(int(self.args["cpu_threads"]) or cores)
        self.tokenizer = load_tokenizer(folder)
        c = self.model.config
        block_size = int(self.args["block_size"])
        bytes_per_block = c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype.itemsize * block_size
        num_blocks = min(int(self._kv_memory() // bytes_per_block), int(self.args["max_kv_blocks"]) or 1 << 62)
        if num_blocks < 2:
            raise ConfigError("resources.memory_limit_gib", "too little memory for the KV cache")
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=bool(self.args["enable_prefix_caching"]))
        self.pacer = PrefillPacer(c, float(self.args["prefill_chunk_s"]))
        # (layers, slots, kv_heads, head_dim): slot = block * block_size + offset. One block more
        # than the manager hands out: the CUDA graphs' padding rows write there.
        shape = (c.num_layers, (num_blocks + 1) * block_size, c.num_kv_heads, c.head_dim)
        self.k_cache, self.v_cache = (zeros(shape, dtype, self.device) for _ in range(2))
        self.graphs = None
        self.overlap = self.device.type == "cuda" if self._overlap_setting == "auto" else self._overlap_setting == "true"
        self.batcher = Batcher(self.blocks, self.pacer, self.speculator, int(self.args["max_num_batched_tokens"]),
                               int(self.args["max_num_seqs"]), self.overlap, self._flush)
        max_model_len = engine.max_model_len or c.max_position_embeddings
        if self.device.type == "cuda" and not self.args["enforce_eager"]:
            from worker.engines.native.graphs import DecodeGraphs

            # Rows: a sequence checking k proposals runs 1 + k of them, and after it 1 + 2k (ahead.checks).
            seqs = int(self.args["max_num_seqs"])
            rows = min(seqs * (1 + 2 * self.speculator.settings.num_tokens), max(seqs, 256))
            self.graphs = DecodeGraphs(self.model, self.k_cache, self.v_cache, rows,
                                       -(-max_model_len // block_size), block_size, num_blocks * block_size)
            self.decode_rows = DecodeRows.in_graphs(self.model.weight_bytes(), bytes_per_block // block_size)
        elif self.model.decode_weights is not None:
            self.decode_rows = DecodeRows.in_one_call(self.pacer.token_flops, self.pacer.pair_flops)
        self.eos_ids = frozenset(c.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        self._load_grammars(c.vocab_size, self.eos_ids)
        self.info = ModelInfo(
            served_name=engine.served_name or (engine.model if "/" not in engine.model else folder.name),
            max_model_len=max_model_len,
            vocab_size=max(c.vocab_size, len(self.tokenizer)),
            kv_bytes_per_token=bytes_per_block // block_size,
        )
        log.info("native engine ready", folder=str(folder), device=str(self.device), dtype=str(dtype),
                 kv_blocks=num_blocks, block_size=block_size, budget_tokens=num_blocks * block_size,
                 cuda_graphs=self.graphs.sizes if self.graphs else None, cpu_kernels=kernels,
                 cpu_isa=cpu_kernels.active())

    async def warmup(self) -> None:
        await super().warmup()
        if self.device.type == "cuda":  # Triton's kernels compile at first use: here, not in service
            await warm_up(self)  # (which ends forgetting)
        else:
            forget_warm_up(self)

    def _kv_memory(self) -> int:
        weights = self.model.weight_bytes()
        if self.config.resources.memory_limit_gib:
            return int(self.config.resources.memory_limit_gib * GIB) - weights
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(min(free, total * float(self.args["gpu_memory_utilization"]) - weights) * 0.95)
        return 2 * GIB

    def _release(self) -> None:
        self.model = self.k_cache = self.v_cache = self.graphs = None
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()  # so the next engine in this process sees the memory as free

    def kv_budget_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size if self.blocks else 0

    def num_unfinished(self) -> int:
        return len(self.batcher) if self.batcher is not None else 0

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        return (self.batcher.prefix_queried_tokens, self.batcher.prefix_hit_tokens) if self.batcher is not None else None

    def speculation_stats(self) -> tuple[int, int, int] | None:
        return self.speculator.stats() if self.speculates else None

    def get_memory_usage(self) -> dict[str, int]:
        if self.device is not None and self.device.type == "cuda":
            return {str(self.device): torch.cuda.memory_allocated(self.device)}
        if self.model is None:
            return {}
        return {"cpu": self.model.weight_bytes() + self.k_cache.numel() * self.k_cache.element_size() * 2}

    def encode(self, request: GenerationRequest) -> list[int]:
        return encode_prompt(self.tokenizer, request)

    def stream_predict(self, request: GenerationRequest) -> RequestStream:
        if (refused := self._refused(request.request_id)) is not None:
            return refused
        stream, params = self.make_stream(request.request_id), request.sampling
        seq = Sequence(
            stream, request, make_generator(params),
            OutputText(self.tokenizer, request.prompt_token_ids, params.stop, self.eos_ids, render=not self.leaves_text),
            list(request.prompt_token_ids),
            matcher=self.grammars.matcher(request.grammar) if request.grammar is not None else None,
            end=min(len(request.prompt_token_ids) + params.max_tokens, self.info.max_model_len),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids))
        seq.proposer = self.speculator.proposer_for(request, seq.plain)
        self._inbox.put(("add", seq))
        return stream

    # --- engine thread ---

    def _serve(self) -> None:
        step: Step | None = None  # launched, its tokens not read yet
        sync_s = 0.0  # how long to wait for the requests admitted into rows that just ended
        while self._take_inbox(block=step is None and not (len(self.batcher) or self._pending), sync_s=sync_s):
            if step is None:
                started = time.monotonic()
                step = self._launch(self.batcher.schedule())
                step.work, step.launched_at = self.batcher.step_work, started
            before = time.monotonic()
            ahead = launch_ahead(self, step) if self.overlap else None
            ahead_s = time.monotonic() - before  # the next step's host work, not this one's cost
            self._emit()  # with overlap: while the step runs on the device
            prefilled = step.prefilled
            rows = sum(c for _, c in step.scheduled)
            self._pending = self._read(step)
            if ahead is not None and ahead.logits is not None:  # its forward pass runs while the masks fill
                ahead.sample(self.grammars)
            if step.verifying and not step.launched_at and not self._pending:  # checks launched ahead, dropped
                step = ahead
                continue
            previous, self.last_step_at = self.last_step_at, time.monotonic()
            if self.speculates and not prefilled:
                if step.launched_at:
                    self.speculator.step_cost.record(rows, self.last_step_at - step.launched_at - ahead_s)
                if self.overlap and not self.batcher.waiting and self.last_step_at - previous < 1.0:  # (not after idling)
                    chained = not step.launched_at and not any(step.drafts)  # (checks launched ahead: proposing)
                    self.speculator.record_period(chained, sum(len(t) for _, t in self._pending),
                                                  step.num_seqs, self.last_step_at - previous)
            if step.work:  # priced: it may have prefilled
                self.pacer.record(step.work, self.last_step_at - step.launched_at, prefilled)
            step = ahead
            if not self.overlap and self._emit():
                # An empty row costs the step 1/rows of its tokens: worth a wait of up to that.
                sync_s = min(0.005, (self.last_step_at - started) / (len(self.batcher.running) + 1))
            else:
                sync_s = 0.0
        self._emit()

    def _open_streams(self) -> list[RequestStream]:
        ended = [seq for seq, _ in self._pending if seq.done and not seq.aborted]  # their last token unsent
        return [seq.stream for seq in [*self.batcher.waiting, *self.batcher.running, *ended]]

    def _on_add(self, seq: Sequence) -> None:
        self.batcher.add(seq)

    def _on_abort(self, stream: RequestStream) -> None:
        for seq in [s for s in [*self.batcher.waiting, *self.batcher.running] if s.stream is stream]:
            self.batcher.drop(seq)
            seq.aborted = True
            self._post(seq.stream.put, RequestOutput(finish_reason="aborted"))

    def _flush(self, seq: Sequence) -> None:
        """A preempted sequence makes no tokens until it runs again: what it holds goes now."""
        if seq.outbox.ids:
            self._post(seq.stream.put, self.messages.flush(seq))

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        # Rows with proposals, and short prompt chunks, are decodes too (DecodeRows): such a step
        # runs in the graphs on CUDA and in the one-call decoder on CPU.
        rows = sum(c for _, c in scheduled)
        if self.graphs is not None and rows <= self.graphs.max_batch:
            if rows == len(scheduled):  # one token each: plain decodes
                return self.graphs.decode([seq for seq, _ in scheduled], self.blocks.block_size)
            if all(self.decode_rows(seq, c) for seq, c in scheduled):
                return self.graphs.rows(scheduled, self.blocks.block_size)
        # Past the graphs prompt chunks are prefills (as rows, 8,192 tokens' tables took an H200 host 15 ms).
        rows_of = self.decode_rows if self.graphs is None else DecodeRows()  # on CPU: the one-call decoder's rows
        batch = batch_of(scheduled, self.blocks.block_size, self.device, rows_of)
        try:
            return self.model(batch, self.k_cache, self.v_cache)
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for seq, _ in scheduled:
                self.batcher.drop(seq)
                seq.aborted = True
                self._post(seq.stream.fail, DeviceOutOfMemory("device out of memory on this step"))
            return None

    def _launch(self, scheduled: list[tuple[Sequence, int]]) -> Step:
        """Queues the step and its sampling; nothing here waits for the device."""
        if not scheduled:
            return Step([])
        logits = self._forward(scheduled)
        if logits is None:  # out of memory; the step's sequences have failed
            return Step([])
        ends = list(itertools.accumulate(kept_rows(seq, count) for seq, count in scheduled))
        for (seq, count), end in zip(scheduled, ends):
            if seq.scores_prompt:
                seq.score_prompt(logits[end - count:end], count)
        step = Step(scheduled)
        # Rows that end their sequence's known tokens get a next one (a chunk mid-prompt does not).
        at = [i for i, (seq, count) in enumerate(scheduled)
              if not seq.draft and seq.num_cached + count == len(seq.tokens)]
        if any(seq.draft for seq, _ in scheduled):
            verifying = [seq for seq, _ in scheduled if seq.draft]
            step.check(pick(logits, [row for (seq, count), end in zip(scheduled, ends) if seq.draft
                                     for row in range(end - count, end)]),
                       verifying, [seq.draft for seq in verifying], [seq.num_cached for seq in verifying])
            for seq in verifying:
                seq.draft = []  # the step's now (Step.drafts)
        if not at:
            return step
        step.ready = [scheduled[i][0] for i in at]
        self._ends += [seq.stream for seq in step.ready if seq.ends_with_next()]
        if len(at) < ends[-1]:  # else every row: no index tensor to build and copy over
            logits = pick(logits, [ends[i] - 1 for i in at])
        step.logits = logits
        return step.sample(self.grammars)

    def _read(self, step: Step) -> list[tuple[Sequence, list[int]]]:
        """The step's outcome on the host: each row's tokens counted in the cache, the sampled (or
        accepted) tokens appended, (sequence, its new tokens) to emit. A sequence that a token ends
        (EOS, a stop id, its length) gives its blocks back here, so the next step does not run it;
        stop strings are found later, in _emit."""
        # At batch 256 on a GPU this thread's passes over the rows can set the step: each is one
        # loop, with no call where none is needed.
        counted = step.scheduled
        if step.verifying:  # counted once their proposals are checked
            checking = {id(seq) for seq in step.verifying}
            counted = [(seq, count) for seq, count in counted if id(seq) not in checking]
        commit = self.blocks.commit
        for seq, count in counted:
            if not seq.done:  # done: ended (a stop string) or aborted since
                seq.num_cached += count
                commit(seq.blocks, seq.tokens, seq.num_cached)
        sampled = self._verified(step) if step.verifying else []
        if not step.ready:
            return sampled
        if step.copied is not None:
            step.copied.synchronize()  # the step's tokens, not the step launched after it
        tokens = step.host_tokens.tolist()
        if step.logprobs is not None:
            asked = [tokens[row] for row in step.rows.asked]
            logprobs = iter(step.logprobs.read(asked))
            for seq in step.ready:
                seq.logprob = next(logprobs) if seq.request.logprobs is not None else None
        drop = self.batcher.drop
        for seq, token in zip(step.ready, tokens):
            if not seq.done:
                sampled.append((seq, [token]))
                seq.append(token)
                if token in seq.stop_ids or seq.at_limit():  # as _append, inline
                    drop(seq)
        return sampled

    def _verified(self, step: Step) -> list[tuple[Sequence, list[int]]]:
        """The rows with proposals: the tokens accepted and one more, appended, and counted in the
        cache but the last (which the next step computes). The runs of a check launched ahead
        that assumed another outcome of the check before are dropped unread (Step.standing)."""
        standing = step.standing()
        if not any(standing):
            return []
        sampled = []
        for seq, tokens in self.speculator.check(step.verifying, step.drafts, step.draft_logits, step.chosen(),
                                                 standing):
            kept = []
            for token in tokens:
                kept.append(token)
                if not self._append(seq, token):
                    break
            if not seq.done:
                seq.num_cached += len(kept)
                self.blocks.commit(seq.blocks, seq.tokens, seq.num_cached)
            sampled.append((seq, kept))
        return sampled

    def _append(self, seq: Sequence, token: int) -> bool:
        """A new token of `seq`; False when it ends the sequence (which gives its blocks back)."""
        seq.append(token)
        if seq.at_limit() or token in seq.stop_ids:
            self.batcher.drop(seq)
            return False
        return True

    def _emit(self) -> int:
        """Text and messages of the tokens last read (messages.py paces them); how many of them ended."""
        sampled, self._pending = self._pending, []
        sent, ended = self.messages.of(sampled, len(self.batcher.running))
        for seq in ended:
            if not seq.done:
                self.batcher.drop(seq)
        outputs, self._ends = [(ENDING, stream) for stream in self._ends], []
        outputs += [(stream.put, output) for stream, output in sent]
        if changes := self.blocks.take_changes():  # the cache's changes since the last step, in its wake-up
            outputs.append((self.events.publish, changes))
        self._post_all(outputs)
        return len(ended)
