"""deepinfer: an offline LLM inference engine (paged KV cache, Triton kernels, Python scheduler).

Public API::

    from deepinfer import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM()  # the embedded default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    outs = llm.generate(["Is water wet?"], SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    vecs = llm.embed(["Hello"])  # [EmbeddingRequestOutput]: outputs.embedding, floats
"""

from deepinfer.engine_args import EngineArgs
from deepinfer.llm import LLM
from deepinfer.lora import LoRARequest
from deepinfer.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from deepinfer.pooling import PoolingParams
from deepinfer.sampling import SamplingParams
from deepinfer.structured import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "EngineArgs", "PoolingParams", "EmbeddingRequestOutput",
           "EmbeddingOutput", "LoRARequest"]
