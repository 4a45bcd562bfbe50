"""TEST DOUBLE of tensorrt_llm.llmapi (1.2): KvCacheConfig only."""

from dataclasses import dataclass


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float = 0.9
    dtype: str | None = None
