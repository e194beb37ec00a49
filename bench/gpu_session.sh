#!/usr/bin/env bash
# One lent-GPU session's work, in stages sized to the device budget: a task drawn for a GPU has
# 15 minutes of device time, all tries together, the machine's start (1-2 minutes) included, and
# at most 10 minutes a call. Run from the repo root:
#
#   here, once (.whl/ is git-ignored):
#                python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                  --implementation cp --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5
#   device call 1 (carry .whl, timeout_s 540):  bash bench/gpu_session.sh tests graphs e2e-host  (~7.5 min)
#   device call 2 (carry .whl), AT ONCE (the machine stays warm only 30 s after a call), with
#   what is left: `e2e-warm e2e-llama` (~3 min), then `attention autocast` (~4 min) if time is left.
#   then give_back.
#   Why this order (2026-11-27, fourth session): a fused step is host-bound (GPT-2 medium 62.6 ms
#   of kernels in a 77-117 ms step, the host issuing it in 92 ms), and fuse(cuda_graphs=True)
#   took GPT-2 medium to 69.3 ms (1.83x eager) and BERT-large to 67.3 ms (1.20x; 0.68x without
#   graphs). Since then (fifth session, no GPU): ops inside graphed blocks choose by GPU time
#   replayed from a CUDA graph (tuner.graph_timer, never run on a GPU yet: `tests` runs its gpu
#   tests; wall time had chosen F.layer_norm for GPT-2's ln_1 and sdpa-flash over cuDNN for BERT,
#   whose kernels took longer); a post-norm block's input is cast once for q, k and v (BERT: five
#   activation casts a layer gone, ~2 ms estimated); each tuning decision records its seconds
#   (the e2e rows' "tuning s": where the 23.6 s set-up goes). `graphs` measures all three;
#   `e2e-host` says which tensors the ~8 dtype conversions a fused GPT-2 block still runs convert;
#   `e2e-llama` adds the graphs row to the Llama 3.2 1B shape; `attention` the dropout-0.1 rows.
#   Sixth session (no GPU): every autocast matmul of an fp32 weight in a fused block computes dW
#   and db in fp32 (kernels/linear.py, torch.mm out_dtype; a dialect against autocast's linear):
#   the ~8 (GPT-2) and 12 (BERT) `direct_copy` conversions a block, 6.5 and 4.2 ms a step, should
#   be gone from `graphs`' top kernels; `tests` runs its gpu test (mm's out_dtype on torch 2.11).
#   And a narrowed norm's dialect now times PyTorch's candidate with its casts (ln_1 of GPT-2).
#   Seventh session (no GPU): the fp32 weight gradients apply in graphed blocks only (ungraphed,
#   the Python autograd.Function costs +147 µs of host a matmul on the CPU proxy: `e2e-host`'s
#   ungraphed rows should not have them, `graphs`' should); and dialects screen before tuning:
#   a candidate more than 2x behind at its default configs is not tuned (the decisions' source
#   says "not tuned"): the e2e rows' "set-up s" and "tuning s" (23.6 s on a fresh machine)
#   should fall, GPT-2's fp32 LayerNorm and the dropout attention no longer tuned there.
#   Ninth session (no GPU): transformers' eager attention under autocast fuses with fp32 q and k
#   (rotary) beside a 16-bit v, MPNet's rounded position bias with and without a mask: tested
#   under CPU autocast only; `autocast` (~1 min) runs those tests under CUDA's, with `attention`.
#   Eleventh session (no GPU): packed sequences on `attention_varlen` (flash-attn's varlen layout) and
#   attn_implementation="trifuse": `tests` runs test_attention_varlen.py in bf16 on sm_90 at
#   sequences of 300-517 tokens; `attention` adds bench_attention_varlen.py (~2 min: varlen
#   and the public op's packed-mask route against the dense block mask, SDPA, FlexAttention,
#   flash-attn). And the dense attention's 16-bit defaults with dropout at head dim 64 spilled
#   registers (compiled for sm_90): now 128x64 at 8 warps for fwd and dQ; GPT-2's and BERT's e2e
#   attention (dropout 0.1) may now be tuned and chosen where the screening dropped it (watch the
#   dialect rows of `graphs`).
#   Twelfth session (no GPU): the suite ran on this box's CPU under the GPU's own torch 2.11,
#   Triton 3.6 and transformers 5.17 (bench/results/README.md): DTensor graphs of 2.11 now fuse.
#   Attention under a mask skips the blocks the mask hides (HAS_BOUNDS): `tests` covers it in bf16
#   (the mask cases of test_attention.py); `attention`'s bench_attention_varlen.py times "trifuse
#   every block" (bounds off) beside "trifuse block mask" (on). The e2e runs have no padding
#   (transformers drops BERT's mask of ones): nothing changes there.
#   Twenty-fourth session (2026-11-30, the first GPU since the fourth): `tests` found block
#   captures failing in a training loop that holds the last loss (the parameters' AccumulateGrad
#   nodes of the step before, made on the default stream) and every later dropout raising after
#   a failed capture; both fixed on the CPU, not yet run on a GPU: next session call 1 `tests
#   bisect graphs e2e-host` (tests-gpu has the new gpu tests; bisect ~1 min: the bf16 attention
#   case with dropout and rows at finfo.min that failed, variant by variant), call 2 `e2e-warm
#   attention` at once (the machine stays warm only 30 s: `e2e-warm` ran on a fresh one).
#   Twenty-fifth session (2026-12-01, no GPU): BERT's biased MLM decoder (30522) now runs padded
#   like GPT-2's head (`graphs`' BERT top kernels should lose the three CUTLASS align2 GEMMs, ~6
#   ms); graphed blocks hand their gradient buffers to .grad without the per-step clone (the
#   "Memcpy DtoD" rows: BERT 432 -> ~48 copies, 1.9 ms; GPT-2 362 -> ~72; peak memory lower by
#   the blocks' gradients; each block after the first reads its input in the block before's graph
#   buffer: 23 fewer 32 MB copies and buffers a step), and a block called again before its backward
#   runs ungraphed (new gpu test in tests-gpu). The next session's calls are as the twenty-fourth's
#   below.
#   Twenty-sixth session (2026-12-01, no GPU): the row-wise kernels (bias + GeLU, dropout + add,
#   gated activations) and the rotary embedding are tuned like the norms (autotune/configs.py
#   rowwise_*, rotary; their defaults are the former fixed plans), and the summing backward
#   passes, the LayerNorm backward's among them, may prefetch the next row tile (PREFETCH, a
#   config of their spaces; compiled for sm_90 here, bench/results/sm90_compile_tuned_spaces.md),
#   and rows up to 1024 wide get one-row LayerNorm backward tiles (BERT's residual stream: 56
#   registers a thread against the default's 236; 2.8 ms a graphed BERT-large step was its share). The e2e runs'
#   first step now also times those spaces ("tuning s" up a little); `rowwise` (~1 min) writes
#   every config's GB/s at the e2e shapes (bench/tune_rowwise.py: was BERT-large's bias + GeLU
#   backward, 92 us = 2.1 TB/s at the default, faster with a prefetch or more warps?), and
#   tests-gpu has test_rowwise_tuning's gpu test (every op measured, replayed, equal to the
#   default config's outputs). Call 2 becomes `e2e-warm rowwise attention`.
#   Twenty-seventh session (2026-12-01, no GPU): the whole suite passed here on the GPU's torch
#   2.11 / Triton 3.6 (`bash .ci/compat`), and Triton 3.6 compiles all 507 launches of the tuned
#   spaces for sm_90. The e2e rows gain "peak reserved GiB" (max_memory_reserved: a graphed
#   block's private pool keeps its freed temporaries, which "peak GiB" does not count; BERT
#   graphs were 16.2 GiB allocated against eager's 14.8) and the graphs summary the pools' GiB:
#   `graphs` says what per-block pools cost. The e2e rows' "costliest decisions" now say where
#   each one's seconds went ("phases": a dialect's reference, check and timing per candidate, the
#   compiles inside the check of a candidate's first call; a kernel's compile and time): the
#   attention dialect's 20.9 s of GPT-2's first step, explained. A dialect's checks also compute
#   their references once per call, not once per candidate. The calls stay as above.
#   Twenty-eighth session (2026-12-01, no GPU): diffusion transformers' adaptive norms
#   (`layer_norm_modulate`: the LayerNorm kernels with per-sample affine rows) are fused in DiT,
#   PixArt, SD3 and Flux; `tests` runs their bf16 tests, and `adaptive` (~1 min) times them at
#   those models' shapes: call 2 becomes `e2e-warm rowwise adaptive attention`. `e2e-dit`
#   (~4 min, a later call) trains diffusers' DiT-XL/2 end to end, eager against fuse.
#   Twenty-ninth session (2026-12-01, no GPU): under CUDA's autocast DiT's modulated norms had not
#   fused at all (a 16-bit x's LayerNorm returns fp32 there, not on CPU); now they do, and write
#   bf16 for their q/k/v and MLP readers. `adaptive` adds that case (DiT's norm1, three readers);
#   `e2e-dit` is the first to see it end to end.
#   Fifty-first session (2026-12-04, H200, bench/results/h200-2026-12-04/): every fused LayerNorm
#   backward had raised KeyError: 'PREFETCH' in the direct launcher, and attention with a value head
#   of 8 beside a wider query head read V wrong; both fixed on the CPU, not yet rerun. GPT-2 medium
#   with graphs 57.2 ms (2.27x). Next: call 1 `tests graphs` (~7 min: the bf16 suite named with -v,
#   the gpu tests, BERT-large's fused rows), call 2 at once `e2e-warm kernels-core` or `attention`.
#   Fifty-second session (2026-12-04, no GPU): a dialect's cold choice compiles all its candidates'
#   kernels together first (one precompile pass; the tuning round's configs likewise): `graphs`'
#   "set-up s" and the attention decision's phases ("compile" then short "check trifuse", 17 s
#   before) say what it saved; tests-gpu's test_gpu_a_cold_choice_compiles_its_candidates_kernels_
#   together checks that no compile is left on the calling thread. Calls as the fifty-first's.
#   Fifty-third session (2026-12-04, H200, bench/results/h200-2026-12-04b/): bf16 suite 745 passed;
#   GPT-2 medium graphed 56.5 ms (2.26x), cold set-up 26.7 s, warm 3.4 s; BERT-large graphed 54.1 ms
#   (1.63x). Fixed on the CPU after: a precompile pass's backward ran on autograd's device thread
#   without the pass's contextvars (compiled and tuned serially there: the attention dQ/dKdV and
#   LayerNorm backward decisions, ~10 s of the cold set-up), and graphed blocks were traced twice
#   (Dynamo guards autocast's cache flag). Next: call 1 `tests graphs-gpt2` (~7 min: set-up s and
#   test_gpu_a_cold_choice...), call 2 at once `autocast graphs-bert` (~4 min).
#   Sixty-second session (2026-12-05, H100, bench/results/h100-2026-12-05/): bf16 suite 745 passed,
#   gpu tests 133 passed; GPT-2 medium graphed 60.4 ms (2.42x eager), BERT-large 58.9 ms (1.32x). The
#   compile backends against torch.compile: trifuse 0.99x / 0.93x, trifuse_inductor 0.90x / 0.80x.
#   Two causes fixed on the CPU after: under any torch.compile transformers' causal mask is a dense
#   tensor (cuDNN 17.2 ms a GPT-2 step where is_causal takes 7.8): a mask computed from literals is
#   now evaluated while compiling and becomes is_causal (normalize.constant_masks); and
#   trifuse_inductor ran trifuse's attention whatever the dialect chose (17.0 ms a BERT step where
#   cuDNN took 9.4): the choice is now made while compiling (backend.attention_as_chosen). Next:
#   call 1 `e2e-compile e2e-compile-bert` (~5 min: did both gaps close?), call 2 at once
#   `e2e-compile-graphs autocast` (~4 min: Inductor's CUDA graphs on both sides; the autocast test
#   fixed for graph replays).
#   Sixty-third session (2026-12-05, no GPU): trifuse_inductor's graphs call each op's direct twin
#   (backend.direct_ops), not the registered op: on this CPU 13 µs less a call, a 24-block GPT-2
#   proxy step's host about 45 -> 25-39 ms (Inductor alone 13.8; this CPU's runs vary). Its
#   narrowed norms write bf16 themselves and its LayerNorm backward dx in x's dtype (a cast after
#   the opaque op was one more pass each: LN backward 3.0 ms a GPT-2 step against 2.24 under fuse).
#   The compile stages now time `compile(backend=trifuse_inductor, direct=0)` beside it (what the
#   twins save), GPT-2's `compile(backend=eager)` (Dynamo's share of backend=trifuse's set-up), and
#   list every kernel by kind.
#   Later sessions, one or two calls each: `e2e-compile` (issue 6's 1.15x over torch.compile and
#   its compile time: never run on the H200), `kernels` (the remaining memory-bound ops), `tma
#   dialects`, `e2e-ckpt` (gradient checkpointing on), `e2e-llama` (Llama 3.2 1B's shape against
#   Liger-Kernel), `tune` (the shipped H100 defaults).
#
# Everything a stage writes (logs, bench/results/*, the exported tuning defaults) comes back as
# ONE file, $OUT/session.tgz (the device returns at most 8 files per call), saved after every
# stage. Unpack it here with `tar xzf <files_at>/session.tgz` and commit bench/results/ with the
# device and versions. Each call's copy of the tree resets the tracked files under bench/results/
# (git-ignored logs/ stays on a warm machine): take a stage's tables from its own call's tarball.
# The device image has torch 2.11, Triton 3.6, transformers, pytest and hypothesis; nothing can
# be installed from the network there, so Liger-Kernel (a baseline) travels as a wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/trifuse-out}
LOGS=bench/results/logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1

# trifuse is the repo root itself: make it importable as `trifuse` without a build step.
mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/trifuse
export PYTHONPATH=/tmp/pkgs${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

stage() {  # stage NAME SECONDS COMMAND...: runs with a time limit, logs to $LOGS/NAME.log, never stops the script
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"
    tail -n 40 "$LOGS/$name.log"
    save
}

save() {  # everything so far into $OUT/session.tgz, after every stage: a call cut by its limit keeps it
    tar czf "$OUT/session.tmp.tgz" bench/results autotune/defaults && mv "$OUT/session.tmp.tgz" "$OUT/session.tgz"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import liger_kernel; print('liger-kernel loads')" 2>&1 | tail -n 1
    git log -1 --format='commit %h %s' 2>/dev/null || true
    date -u
} > "$LOGS/device.txt" 2>&1
cat "$LOGS/device.txt"

# The compile stages' providers; the last: trifuse_inductor's graphs calling the registered ops
# instead of their direct twins (what the twins save).
COMPILE_PROVIDERS="eager-sdpa,torch.compile,compile(backend=trifuse),compile(backend=trifuse_inductor)"
COMPILE_PROVIDERS+=",compile(backend=trifuse_inductor, direct=0)"
for what in "$@"; do
    case $what in
        tests)  # what only a GPU shows: bf16 compiled (CPU runs it interpreted), Triton 3.6 natively, gpu tests.
                # Compiling the kernels takes most of it: 8 pytest-xdist workers (in the device
                # image) compile on 8 of its 16 cores, one GPU shared (2026-11-27, second session:
                # 410 bf16 tests in 82 s, 86 gpu tests in 70 s; on one process it was 8 and 52).
            # TRIFUSE_AUTOTUNE=0: each kernel's default config only (as on CPU), not every config of
            # its space compiled and timed per shape; the tuners have their own gpu tests below.
            # 410 tests, the issues' ops first.
            stage tests-bf16 150 env TRIFUSE_AUTOTUNE=0 python3 -m pytest -v -n 8 -p no:cacheprovider \
                -k "bf16 or bfloat16" tests/kernels/test_{layer_norm,residual_stream,bias_gelu,dropout_add}.py \
                tests/kernels/test_{rotary,gated_activation,cross_entropy,attention,attention_varlen}.py \
                tests/kernels/test_adaptive_norm.py tests/kernels/test_adaptive_norm_rows.py \
                tests/kernels/test_gated_adaptive_norm_rows.py \
                tests/kernels/test_group_norm.py tests/kernels/test_xielu.py tests/kernels/test_channel_norm.py
            # the kernels' and the launcher's gpu tests first, the 81 attention-dialect ones last
            # (the tests over 2^31 elements take 4-16 GiB each: 8 workers at once ran out of memory
            # on the H200, 2026-12-04; they run after, one at a time)
            stage tests-gpu 120 python3 -m pytest -q -rf -n 8 --maxfail=20 -p no:cacheprovider -m "gpu and not slow" \
                tests/kernels tests/fusion tests/autotune
            stage tests-gpu-slow 60 python3 -m pytest -q -rf -p no:cacheprovider -m "gpu and slow" \
                tests/kernels tests/fusion tests/autotune ;;
        tests-gpu)  # the gpu tests alone (no bf16 sweep), each named (a cut run keeps the failures' names)
            stage tests-gpu 150 python3 -m pytest -v -rf -n 8 --maxfail=20 -p no:cacheprovider -m "gpu and not slow" \
                tests/kernels tests/fusion tests/autotune ;;
        bisect-configs)  # the 16-bit attention forward that failed on the H200 (2026-12-04), config by config
            stage bisect-attention-configs 100 python3 bench/bisect_attention_configs.py ;;
        graphs-gpt2)  # GPT-2 medium's steps alone: eager, fused, fused + graphs
            stage bench-e2e-graphs 150 python3 bench/bench_e2e.py --steps 6 --models gpt2-medium --suffix graphs \
                --providers "eager-sdpa,trifuse.fuse,trifuse.fuse(cuda_graphs)" ;;
        graphs-bert)  # BERT-large's steps alone: eager, fused, fused + graphs
            stage bench-e2e-bert-graphs 150 python3 bench/bench_e2e.py --steps 6 --models bert-large --suffix bert-graphs \
                --providers "eager-sdpa,trifuse.fuse,trifuse.fuse(cuda_graphs)" ;;
        bisect)  # the bf16 attention case that failed on the H200 (2026-11-30): which feature does it
            stage bisect-attention 90 python3 bench/bisect_attention.py ;;
        host)  # wall µs per call at tiny sizes, trifuse against PyTorch, and a cProfile of one case
            stage profile-host 75 python3 bench/profile_host.py ;;
        kernels-core)  # the issues' speed targets first: LayerNorm, the residual stream, bias+GeLU, dropout+add,
                       # at their target shapes (--quick): host overhead, then each shape's whole-call
                       # time and its CUDA-graph replay (the kernels alone). Full sweeps: `kernels`.
            for op in layer_norm residual_stream bias_gelu dropout_add; do
                stage "bench-$op" 80 python3 "bench/bench_$op.py" --quick
            done ;;
        kernels)  # the memory-bound ops, 9 x 90 s
            for op in layer_norm residual_stream bias_gelu gated_activation dropout_add rotary group_norm xielu \
                      channel_norm; do
                stage "bench-$op" 90 python3 "bench/bench_$op.py"
            done ;;
        channel-norm)  # the norms over a map's channels (eighty-second session, never on a GPU yet): bf16 tests,
                       # then the kernels against the row path on a copy, eager and torch.compile
            stage tests-channel-norm 60 env TRIFUSE_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider \
                tests/kernels/test_channel_norm.py
            stage bench-channel_norm 120 python3 bench/bench_channel_norm.py ;;
        autocast)  # the patterns written for autocast, under CUDA's (its softmax computes fp16 input in
                   # fp32, CPU's in fp16): eager attention of fp32 q beside 16-bit v, position biases
            stage tests-autocast 90 env TRIFUSE_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider \
                -k "autocast" tests/patterns tests/fusion ;;
        attention)  # attention (SDPA's backends, Gemma 2's soft cap against FlexAttention) and the LM head
            stage bench-attention 240 python3 bench/bench_attention.py
            stage bench-attention-varlen 120 python3 bench/bench_attention_varlen.py
            stage bench-cross_entropy 120 python3 bench/bench_cross_entropy.py ;;
        tma)  # the attention forward through tensor descriptors (opt-in, TRIFUSE_ATTENTION_TMA=1):
              # natively on sm_90 first (fp16 and bf16 against float64), then its speed. Its own
              # processes: a fault here cannot take the other stages' results with it.
            stage tests-tma 150 env TRIFUSE_ATTENTION_TMA=1 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_attention.py -k "tma or bf16 or bfloat16"
            stage bench-attention-tma 200 python3 bench/bench_attention.py --tma ;;
        dialects)  # which implementation wins per op and shape, against each candidate alone
            stage bench-dialects 200 python3 bench/bench_dialects.py ;;
        e2e)  # GPT-2 medium training steps: eager, trifuse.fuse, trifuse.fuse(skip_logits); the
              # first fused step tunes the kernels at the model's shapes (set-up s)
            stage bench-e2e 300 python3 bench/bench_e2e.py --steps 8 --models gpt2-medium ;;
        e2e-compile)  # issue 6 on GPT-2 medium: eager, torch.compile, compile(backend=trifuse) and
                      # compile(backend=trifuse_inductor), each with its compile time as set-up s
                      # (torch.compile took 69 s there on the H100); one call of its own
                      # (E2E_COMPILE_LIMIT: the stage's seconds, to fit what is left of the budget)
            # (compile(backend=eager): Dynamo's share of backend=trifuse's set-up)
            stage bench-e2e-compile "${E2E_COMPILE_LIMIT:-540}" python3 bench/bench_e2e.py --steps 6 --models gpt2-medium --compile \
                --suffix compile \
                --providers "$COMPILE_PROVIDERS,compile(backend=eager)" ;;
        e2e-compile-bert)  # the same providers on BERT-large (~100 s on the H100, 2026-12-05)
            stage bench-e2e-compile-bert "${E2E_COMPILE_LIMIT:-300}" python3 bench/bench_e2e.py --steps 6 --models bert-large \
                --compile --suffix bert-compile \
                --providers "$COMPILE_PROVIDERS" ;;
        e2e-compile-graphs)  # Inductor's CUDA graphs (mode="reduce-overhead") with and without trifuse, both models
            stage bench-e2e-compile-graphs "${E2E_COMPILE_LIMIT:-300}" python3 bench/bench_e2e.py --steps 6 \
                --models gpt2-medium,bert-large --compile --suffix compile-graphs \
                --providers "compile(mode=reduce-overhead),compile(backend=trifuse_inductor, mode=reduce-overhead)" ;;
        e2e-ckpt)  # the same with transformers' gradient checkpointing on
            stage bench-e2e-ckpt 300 python3 bench/bench_e2e.py --steps 6 --models gpt2-medium --grad-ckpt \
                --suffix grad-ckpt ;;
        e2e-bert)  # BERT-large (B16 S512) training steps: eager against trifuse.fuse
            stage bench-e2e-bert 300 python3 bench/bench_e2e.py --steps 8 --models bert-large --suffix bert ;;
        e2e-llama)  # Llama 3.2 1B's shape (RoPE, SwiGLU, GQA): eager, trifuse.fuse, Liger-Kernel
            stage bench-e2e-llama 300 python3 bench/bench_e2e.py --steps 6 --models llama-1b --suffix llama ;;
        graphs)  # fuse(cuda_graphs=True): the real graphs against the ungraphed fused model (gpu tests),
                 # then GPT-2 medium's and BERT-large's steps (eager, fused, fused + graphs); the NCCL
                 # example between them (its first run failed in AdamW's for-each step, since fixed)
            stage tests-graphs 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/fusion/test_block_graphs.py
            stage bench-e2e-graphs 150 python3 bench/bench_e2e.py --steps 6 --models gpt2-medium --suffix graphs \
                --providers "eager-sdpa,trifuse.fuse,trifuse.fuse(cuda_graphs)"
            stage nccl-tp 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_tp.py --steps 6
            stage bench-e2e-bert-graphs 150 python3 bench/bench_e2e.py --steps 6 --models bert-large --suffix bert-graphs \
                --providers "eager-sdpa,trifuse.fuse,trifuse.fuse(cuda_graphs)" ;;
        e2e-warm)  # set-up of a second process, with the Triton and tuning caches the stages before left on
                   # disk (issue 5's < 10 s): run it after `graphs` on the same machine
            stage bench-e2e-warm 120 python3 bench/bench_e2e.py --steps 4 --models gpt2-medium --suffix warm \
                --providers "trifuse.fuse(cuda_graphs)" ;;
        e2e-host)  # where a fused GPT-2 medium step's host time and dtype conversions go, with and without graphs
            stage profile-e2e-host 120 python3 bench/profile_e2e_host.py --models gpt2-medium \
                --providers "trifuse.fuse,trifuse.fuse(cuda_graphs)" ;;
        nccl)  # issue 8 on the lent GPU: the TP+SP example over NCCL at world size 1, end to end
               # (fused; PyTorch's ops; the vocabulary-parallel head), a few steps each
            stage nccl-tp 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_tp.py --steps 6
            stage nccl-tp-unfused 45 python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_tp.py --steps 6 --no-fuse
            stage nccl-tp-vocab 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_tp.py --steps 6 \
                --vocab-parallel ;;
        adaptive)  # the diffusion transformers' adaptive norm (DiT, PixArt, SD3, Flux shapes) against
                   # PyTorch's norm, product and sum, eager and compiled, and DiT's norm1 under
                   # autocast for three readers (~1.5 min)
            stage bench-adaptive_norm 150 python3 bench/bench_adaptive_norm.py ;;
        e2e-dit)  # diffusers' DiT-XL/2 (256 px, B32) training: eager against fuse, with and without graphs
            stage bench-e2e-dit 300 python3 bench/bench_e2e.py --steps 6 --models dit-xl --suffix dit \
                --providers "eager-sdpa,trifuse.fuse,trifuse.fuse(cuda_graphs)" ;;
        rowwise)  # every config of the row-wise kernels' spaces at the e2e shapes, in GB/s
            stage tune-rowwise 90 python3 bench/tune_rowwise.py ;;
        tune)  # this GPU's winners, shipped as defaults for its family (and the same chip's: H100/H200)
            stage tune 150 python3 -m trifuse.autotune gpt2-medium --batch 8 --seq 1024
            stage tune-llama 150 python3 -m trifuse.autotune llama-3.2-1b --batch 4 --seq 2048 \
                --export-defaults autotune/defaults/ ;;  # this GPU's family: h100.json or h200.json
        *) echo "unknown stage $what (tests tests-gpu bisect bisect-configs graphs-gpt2 graphs-bert e2e-compile e2e-compile-bert e2e-compile-graphs host kernels-core kernels attention tma dialects e2e e2e-ckpt e2e-bert e2e-llama e2e-dit graphs e2e-host nccl adaptive rowwise tune)" ;;
    esac
done

save
ls -l "$OUT"
