"""Mixture-of-experts models under tensor parallelism (real gloo ranks on CPU, tiny random
checkpoints): every rank holds all experts over its block of the intermediate size (and of
Qwen2-MoE's shared expert), OLMoE's whole-width q/k norm all-reduces its statistics. The
greedy tokens and top-3 log-probabilities of ``LLM(..., tensor_parallel_size=N)`` must
equal the one-rank run's (fp32: the all-reduce reorders sums, ~1e-6 apart).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.distributed.run_files import ENV, ROOT
from tests.models.moe_checkpoints import make_moe_checkpoints

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _stacked_copy(src: str, dst) -> str:
    """The checkpoint with its experts stacked (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``), as transformers 5 saves them: the gate/up tensor is
    the one a rank cuts in two blocks."""
    import torch

    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            block, rest = name.split(".experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(block, {}).setdefault(proj, {})[int(e)] = t
        else:
            out[name] = t
    for block, projs in experts.items():
        n = len(projs["gate_proj"])
        out[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{block}.experts.down_proj"] = torch.stack(
            [projs["down_proj"][e] for e in range(n)])
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_moe_models_split_equal_one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_moe")
    ck = make_moe_checkpoints(root)
    cases = [  # (checkpoint, tp): the tp=4 ones replicate the 2 KV heads
        (ck["qwen2_moe"].path, 4),  # shared expert, qkv bias
        (ck["olmoe"].path, 4),  # whole-width q/k norm, clip_qkv
        (ck["mixtral"].path, 2),
        (_stacked_copy(ck["qwen3_moe"].path, root / "qwen3_stacked"), 2),
    ]
    script = root / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from deepinfer import LLM, SamplingParams

        if __name__ == "__main__":
            prompts = [[5, 17, 42, 99, 3, 8, 250, 12, 77, 31, 64, 128, 200, 7, 19, 23, 41],
                       [9, 8, 7]]
            sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
            kw = dict(device="cpu", kv_cache_memory=8 << 20, max_model_len=64)
            for path, tp in {cases!r}:
                runs = []
                for size in (1, tp):
                    with LLM(path, tensor_parallel_size=size, **kw) as llm:
                        outs = llm.generate(prompts, sp, use_tqdm=False)
                    runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                                 for o in outs])
                print(json.dumps({{"path": path, "tp": tp, "runs": runs}}), flush=True)
    """))
    res = subprocess.run([sys.executable, str(script)], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert len(results) == len(cases)
    for r in results:
        one, split = r["runs"]
        for (tok1, lp1), (tok_n, lp_n) in zip(one, split):
            assert tok_n == tok1, r["path"]
            for step1, step_n in zip(lp1, lp_n):
                assert step1.keys() == step_n.keys(), (r["path"], step1, step_n)
                for tok, lp in step1.items():
                    assert abs(lp - step_n[tok]) < 1e-5, (r["path"], r["tp"], tok)
