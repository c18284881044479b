"""``deepinfer-generate``'s command line: parsing and dispatch only.

The engine flags come from ``EngineArgs``' field declarations (one flag a field), the
sampling defaults and job flags are declared here. Three ways to run, all through the
one loop of ``deepinfer.jobs.run_loop``: one engine (``deepinfer.jobs.one_engine``), data
and/or tensor parallel (``--dp M``, ``--tp N`` or torchrun; ``deepinfer.jobs.dp_job``)
and disaggregated prefill/decode (``--pd P:D``; ``deepinfer.jobs.pd_job``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import fields

from deepinfer.distributed.pd import parse_pd
from deepinfer.distributed.ranks import check_gpu_count, launch, torchrun_world_size
from deepinfer.distributed.tp import check_layout
from deepinfer.engine_args import EngineArgs
from deepinfer.jobs.dp_job import dp_rank
from deepinfer.jobs.formats import FORMATS, NATIVE, job_format
from deepinfer.jobs.input_records import lora_requests
from deepinfer.jobs.one_engine import run_one_engine
from deepinfer.jobs.pd_job import pd_job_rank
from deepinfer.jobs.ray_job import run_ray_job
from deepinfer.jobs.resume import check_output_format, lock_output
from deepinfer.loading.loader import load_config
from deepinfer.models.tensor_parallel import check_tp_size
from deepinfer.pooling import PoolingParams
from deepinfer.sampling.params import SamplingParams
from deepinfer.tokenizer import check_template_kwargs

# Exit status after Ctrl-C (128 + SIGINT, as a shell reports a process it interrupted).
EXIT_INTERRUPTED = 130


def flag_name(field_name: str) -> str:
    """``max_model_len`` -> ``--max-model-len``."""
    return "--" + field_name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per command-line field of ``EngineArgs`` (see ``engine_args.option``);
    booleans (and ``bool | None`` fields, declared with ``type=bool``) get ``--x`` /
    ``--no-x``."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        names = [meta.get("flag") or flag_name(f.name), *meta.get("aliases", ())]
        kwargs: dict = {"default": f.default, "help": meta["help"], "dest": f.name}
        if isinstance(f.default, bool) or meta.get("type") is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta.get("type") or type(f.default)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        group.add_argument(*names, **kwargs)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """``EngineArgs`` from the parsed flags."""
    return EngineArgs(**{f.name: getattr(args, f.name) for f in fields(EngineArgs)
                         if f.metadata.get("cli", True)})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-generate", description="Offline batch generation with deepinfer."
    )
    p.add_argument("--input", required=True, help=".txt (one prompt per line) or .jsonl "
                   "(deepinfer's records, or an OpenAI batch file)")
    p.add_argument("--output", required=True, help=".jsonl; appended to, and resumed from")
    add_engine_flags(p)
    s = p.add_argument_group(
        "default sampling (per-record values override them; unset, deepinfer's records "
        "take max-tokens 128 and temperature 0, an OpenAI batch file OpenAI's defaults: "
        "temperature 1 and the rest of the context)")
    s.add_argument("--max-tokens", type=int, default=None)
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=None, dest="request_seed",
                   help="the seed of every line without its own (each line then samples "
                   "reproducibly alone; --engine-seed seeds the run's stream instead)")
    s.add_argument("--n", type=int, default=1)
    j = p.add_argument_group("job")
    j.add_argument("--chat", action="store_true",
                   help="apply the chat template to plain prompts (.txt/.jsonl; in an "
                   "OpenAI batch file each line's url decides)")
    j.add_argument("--chat-template-kwargs", type=_template_kwargs, default=None,
                   metavar="JSON", help="variables for the chat template of every chat "
                   "line, e.g. '{\"enable_thinking\": false}' (a line's own "
                   "chat_template_kwargs win, key by key)")
    j.add_argument("--embed", action="store_true",
                   help="embed each prompt instead of generating (.txt/.jsonl): its line "
                   "is {\"id\", \"embedding\": [...]}, the last token's hidden state, "
                   "unit length (an OpenAI batch file asks per line: /v1/embeddings)")
    j.add_argument("--dimensions", type=int, default=None, metavar="N",
                   help="with --embed: keep the first N values of each embedding")
    j.add_argument("--format", choices=FORMATS, default="auto",
                   help="input/output format (auto: OpenAI batch when the first line has "
                   "custom_id and body)")
    j.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="OpenAI batch output: name logprob tokens 'token_id:<id>' instead "
                   "of their text (vLLM's flag)")
    j.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="requests submitted and not finished at a time: the input is read "
                   "as the run goes (default: 4 x max-num-seqs per engine)")
    j.add_argument("--show", action="store_true", help="print each result when done")
    j.add_argument("--no-progress", action="store_true")
    j.add_argument("--dp", type=int, default=1,
                   help="data-parallel ranks on this machine (one GPU each on CUDA; "
                        "ignored under torchrun, which sets the ranks)")
    j.add_argument("--dp-timeout", type=float, default=120.0,
                   help="seconds a rank waits on the others before giving up (DP and PD "
                        "runs)")
    j.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray Data (pip install 'deepinfer[ray]'): independent "
                   "replicas, on a local Ray cluster or the one at ADDRESS")
    j.add_argument("--replicas", type=int, default=1,
                   help="engines of a --ray run (each with --tp GPUs on CUDA)")
    j.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                   help="a PEFT LoRA adapter folder that lines naming it ({\"lora\": "
                   "\"NAME\"}) run with; repeat for more (the others run the base model)")
    j.add_argument("--pd", default=None, metavar="P:D",
                   help="disaggregated prefill/decode: P prompt + D completion engines, "
                        "spawned on this machine (one GPU each on CUDA), or under torchrun "
                        "with WORLD_SIZE = P + D; n = 1 only")
    return p


def check_output_path(input_path: str, output: str) -> None:
    """``ValueError`` naming ``--output`` when it is a folder or the input file itself
    (resume would read the prompts as results, and the run overwrite them)."""
    if os.path.isdir(output):
        raise ValueError(f"--output {output!r}: is a folder; name a .jsonl file")
    if os.path.exists(output) and os.path.exists(input_path) and os.path.samefile(
            input_path, output):
        raise ValueError(f"--output {output!r} is the --input file: the results would "
                         "overwrite the prompts; name another file")


# What a line leaves out when no flag sets it: deepinfer's own records are greedy and
# short; an OpenAI batch line means what it means to OpenAI's API (and vLLM's run-batch):
# temperature 1 and up to the rest of the context (the engine cuts max_tokens at
# max_model_len).
NATIVE_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}
OPENAI_DEFAULTS = {"max_tokens": 1 << 62, "temperature": 1.0}


def _template_kwargs(text: str) -> dict:
    """``--chat-template-kwargs``: a JSON object of template variables (argparse exits 2
    naming the flag otherwise)."""
    try:
        return check_template_kwargs(json.loads(text), "--chat-template-kwargs")
    except (json.JSONDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {e}") from None


def check_ray_flags(args: argparse.Namespace, world: int) -> None:
    """``ValueError`` naming the flag for a ``--ray`` run that cannot be (or ``--replicas``
    without ``--ray``)."""
    if args.ray is None:
        if args.replicas != 1:
            raise ValueError(f"--replicas {args.replicas}: only with --ray")
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: expected a positive number of "
                         "engines")
    for flag, on in (("--dp", args.dp > 1), ("--pd", args.pd is not None),
                     ("torchrun", world > 1)):
        if on:
            raise ValueError(f"--ray and {flag} cannot be combined: Ray runs independent "
                             "replicas (--replicas N) of its own")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'deepinfer[ray]'") from None


def check_lora_flags(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """``--lora``: the adapters parse, and the run can serve them (``enable_lora`` set on
    ``engine_args``); ``ValueError`` naming the flag otherwise."""
    if not lora_requests(args.lora):
        return
    for flag, on in (("--ray", args.ray is not None), ("--pd", args.pd is not None),
                     ("--tp", engine_args.tensor_parallel_size > 1)):
        if on:
            raise ValueError(f"--lora and {flag} cannot be combined yet (one engine or "
                             "--dp replicas serve adapters)")
    engine_args.enable_lora = True


def check_embed_flags(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """``ValueError`` naming the flag for ``--embed`` / ``--dimensions`` values that
    cannot run (a ``--dimensions`` past the model's ``hidden_size`` included)."""
    if not args.embed:
        if args.dimensions is not None:
            raise ValueError(f"--dimensions {args.dimensions}: only with --embed")
        return
    for flag, on in (("--pd", args.pd is not None), ("--ray", args.ray is not None),
                     ("--n", args.n != 1)):
        if on:
            raise ValueError(f"--embed and {flag} cannot be combined")
    try:
        PoolingParams(dimensions=args.dimensions).validate(
            load_config(engine_args.model).hidden_size)
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def default_sampling_params(args: argparse.Namespace, openai: bool = False) -> SamplingParams:
    """The CLI's default sampling; per-record overrides are applied on top. The flags
    given are set; the format's defaults stay ``unset``, so the model's
    ``generation_config.json`` comes before them (line > flag > model > built-in)."""
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k}
    base = SamplingParams.defaults(**(OPENAI_DEFAULTS if openai else NATIVE_DEFAULTS),
                                   seed=args.request_seed, n=args.n)
    return base.replace(**{k: v for k, v in flags.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world = torchrun_world_size()
    try:
        engine_args = engine_args_from(args)
        engine_args.validate()
        check_lora_flags(args, engine_args)
        check_output_path(args.input, args.output)
        check_embed_flags(args, engine_args)
        inputs, fmt = job_format(args, engine_args.model)
        check_output_format(args.output, openai=fmt is not NATIVE)
        default_params = default_sampling_params(args, openai=fmt is not NATIVE)
        if args.dp < 1:
            raise ValueError(f"--dp {args.dp}: expected a positive number of ranks")
        check_ray_flags(args, world)
        if args.max_in_flight is not None and args.max_in_flight < 1:
            raise ValueError(f"--max-in-flight {args.max_in_flight}: expected a positive "
                             "number of requests")
        if args.dp_timeout <= 0:
            raise ValueError(f"--dp-timeout {args.dp_timeout}: expected seconds > 0")
        tp = engine_args.tensor_parallel_size
        if tp > 1:
            if args.pd is not None:
                raise ValueError(f"--pd {args.pd} and --tp {tp} cannot be combined: the "
                                 "prefill/decode hand-off moves whole KV blocks, not shards")
            try:
                check_tp_size(load_config(engine_args.model), tp)
            except ValueError as e:
                raise ValueError(f"--tp {tp}: {e}") from None
            dp = check_layout(args.dp, tp, world)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world else 0
            if world and local % tp:
                raise ValueError(f"--tp {tp}: LOCAL_WORLD_SIZE={local} is not a multiple of "
                                 "it; a tensor-parallel group must sit on one node")
            if not world:  # spawned here: one GPU per rank on this node (torchrun: per node)
                check_gpu_count(args.device, dp * tp, f"--dp {dp} --tp {tp}")
        if args.pd is not None:
            num_prompt, num_decode = parse_pd(args.pd)
            if args.dp > 1:
                # Each PD process is one engine of one role; a DP group of PD groups
                # would need a second level of process groups. Not implemented.
                raise ValueError(f"--pd {args.pd} and --dp {args.dp} cannot be combined: "
                                 "use --pd alone (more P or D ranks) or --dp alone")
            if world and world != num_prompt + num_decode:
                raise ValueError(f"--pd {args.pd} needs WORLD_SIZE={num_prompt + num_decode}"
                                 f"; the launcher set {world}")
            if not world:  # spawned here: one GPU per rank on this node (torchrun: per node)
                check_gpu_count(args.device, num_prompt + num_decode, f"--pd {args.pd}")
        elif tp == 1 and world > 1 and args.dp > 1 and args.dp != world:
            raise ValueError(f"--dp {args.dp} disagrees with WORLD_SIZE={world} set by the "
                             "launcher")
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        return 2
    try:
        # One run per output file (under torchrun: rank 0 holds it for the run).
        lock = lock_output(args.output) if os.environ.get("RANK", "0") == "0" else None
    except ValueError as e:
        print(f"deepinfer-generate: {e}", file=sys.stderr)
        return 2
    try:
        if args.ray is not None:
            return run_ray_job(args, engine_args, default_params, inputs, fmt)
        if args.pd is not None:
            return launch(pd_job_rank, num_prompt + num_decode,
                          (args, engine_args, default_params, num_prompt))
        if args.dp > 1 or world > 1 or tp > 1:
            return launch(dp_rank, args.dp * tp, (args, engine_args, default_params))
        return run_one_engine(args, engine_args, default_params, inputs, fmt)
    except KeyboardInterrupt:
        # Ctrl-C: the spawned ranks are stopped on the way out (spawn_ranks); every
        # record written so far is whole and kept, so a rerun resumes.
        if os.environ.get("RANK", "0") == "0":  # once per run, also under torchrun
            print("\ndeepinfer-generate: interrupted: rerun the same command to resume",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if lock is not None:  # the file goes too: an output folder holds only outputs
            with contextlib.suppress(OSError):
                os.unlink(lock.name)
            lock.close()
