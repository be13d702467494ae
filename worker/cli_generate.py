"""`kvroute generate`: offline generation with the worker engine, one prompt after another.

Give `--prompt` several times to watch the prefix cache: a later prompt that starts like an earlier one
reports `cached_tokens` > 0.
"""

from __future__ import annotations

import argparse
import json

from kvroute.errors import UserError
from kvroute.sampling import InvalidRequest, SamplingParams
from worker.cli_worker import add_weight_arguments
from worker.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | sim | a .gguf file | an HF directory")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    add_weight_arguments(parser)
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from worker.cli_worker import check_device
    from worker.engine import LLMEngine

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        weights=args.weights,
        weight_group_size=args.weight_group_size,
        weight_scheme=args.weight_scheme,
        attention_backend=args.attention_backend,
        device=args.device,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    check_device(args.device)
    try:
        params.validate()
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    tokenizer = engine.tokenizer
    for text in args.prompt:
        try:
            if args.chat:
                prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            else:
                prompt_ids = tokenizer.encode(text, add_special_tokens=True)
            result = engine.generate([prompt_ids], params)[0]
        except (InvalidRequest, ValueError) as exc:
            raise UserError(str(exc)) from exc
        output = tokenizer.decode(result.token_ids)
        if args.json:
            record = {
                "token_ids": result.token_ids,
                "text": output,
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
            }
            print(json.dumps(record))
        else:
            print(output)
    return 0
