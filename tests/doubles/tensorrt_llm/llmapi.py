"""TEST DOUBLE of tensorrt_llm.llmapi (1.2): KvCacheConfig and GuidedDecodingParams only."""

from dataclasses import dataclass, fields


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float = 0.9
    dtype: str | None = None


@dataclass(kw_only=True)
class GuidedDecodingParams:
    json: str | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self):
        if sum(bool(getattr(self, f.name)) for f in fields(self)) > 1:
            raise ValueError("Only one guide can be used for a request")
