"""`kvroute quality`: judge a candidate engine configuration against a reference on the same engine and model.

    config_spec      `weights=int4,kv-cache-dtype=fp8,chat-template=FILE` -> an EngineConfig and a chat template
    prompts          the built-in prompts or a JSONL file, rendered by the model's tokenizer (kvroute.tokenizer)
    template_check   refuse when the two sides' rendered prompts differ, naming where (exit 3)
    engine_runs      greedy answers under a batching, next-token logits along a given path
    measures         top-1 agreement and KL per position, flip rates and their paired difference with 95% bounds
    drift            long outputs: agreement by output position, first divergence of free-running greedy
    decision_rule    `flips_above_floor<=0.02,top1>=0.97`, parsed strictly, and the verdict it gives
    protocol         the run: checks first, then the reference twice (the noise floor), the candidate, the measures
    report / plot    the one-screen text, the JSON and the PNG
    cli              the subcommand (exit 0 pass, 1 fail, 2 usage error, 3 refused by the template check)

The protocol, how to read its report and measured runs: docs/quantization.md.
"""
