"""deepinfer: an offline LLM inference engine (paged KV cache, Triton kernels, Python scheduler).

Public API::

    from deepinfer import LLM, SamplingParams
    llm = LLM()  # the embedded default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from deepinfer.engine_args import EngineArgs
from deepinfer.llm import LLM
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
