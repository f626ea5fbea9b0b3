#!/usr/bin/env bash
# One device-tool call's worth of GPU measurement (each stage under 10 minutes on one H200), run
# from a snapshot of the repository on the GPU machine after TVM's bundle is unpacked there
# (../shared/gpu/tvm-bundle.sh, two calls). Every comparison is `autofuse compare` itself, the
# same pipeline and report (report.json/.md, and the plots where matplotlib is installed) as on a
# CPU; this script only names the shapes and the contenders. Writes under $OUT; commit the
# reports under benchmarks/results/h200/.
#
# The snapshot has no .git: pass the commit it was taken from, or the reports say "unknown":
#   AUTOFUSE_COMMIT=$(git rev-parse HEAD)   (here, on a clean tree, before the call)
#   source /opt/autofuse-gpu/env.sh && AUTOFUSE_COMMIT=<sha> bash benchmarks/gpu_session.sh measure
#
#   measure   GEMM tile sweeps, then the patterns at LLM-scale shapes in float32 (and the row
#             patterns in float16) against every GPU baseline
#   tune      first tuning on the GPU: 16 trials each of linear_bias_relu and softmax_dropout,
#             large shapes, then compared
#   check     XLA on the GPU on the patterns it gained ops for; the templates changed since
#             (uneven rows, padded keys); attention against torch SDPA
#   kernels   the Hopper kernel templates (issues 22, 23), at most 9.5 minutes: compare in float16 of
#             linear_bias_relu 4096^3, swiglu_ffn 4096 x 4096 x 11008, flash_attention B8 H16
#             S2048 D128 and gqa_decode_attention (batch 16, 32/8 heads, D128, cache 4000 of 4096)
#             against torch eager, torch.compile and SDPA, and int8_matmul_dequant 4096^3 (in its
#             dtype, float32, so a compare of its own) against torch eager (cuBLAS int8) and
#             torch.compile; their GPU tests (tests/test_kernel_templates_gpu.py); the float16
#             decoder_block against torch.compile. Everything lands in $OUT/kernels.tar.gz (the
#             device returns at most 8 files) and the log in $OUT/kernels.log. KERNEL_STEPS
#             (default compare,tests,model) picks the parts: compare alone takes at most 330 s and
#             is gemm,int8,attention, each of which can be named alone.
#             KERNEL_BASELINES adds contenders to every compare (e.g. xla,tvm-auto; each compare's
#             timeout grows by KERNEL_EXTRA_SECS, default 0)
#   parity    issue 20: three patterns of gpu-large2-float32.json timed by the old benchmarks/gpu.py
#             (the code that measured it, e3eb7cd, from OLD_TREE, default .gpuold/tree.tar.gz:
#             `git archive e3eb7cd autofuse search_spaces benchmarks/gpu.py | gzip`) and by `autofuse
#             compare`, on one card in one call. Lands in $OUT/parity.tar.gz
#   decode-grid  issue 23: gqa_decode_attention (GQA 32/8, D128, float16, the new token at the
#             cache's last row: cache_len = CACHE - 1 of max_seq CACHE) at batch 1, 16, 64 x cache 1024,
#             4096, 16384, 32768 through `autofuse compare` against torch SDPA (torch.compile and
#             XLA-GPU with DECODE_BASELINES=torch-sdpa,torch-compile,xla; their compiles cost
#             minutes: DECODE_BATCHES and DECODE_CACHES split the grid over calls). Lands in
#             $OUT/decode-grid.tar.gz, one report per shape (DECODE_TIMEOUT seconds each, default 150)
#   verify    issue 23: spec_verify_attention's kernels (the split kernel at batch 1, the tensor-core
#             prefill from 16 (batch, K/V head) pairs): its and paged_attention's GPU tests
#             (VERIFY_TESTS=0: none), then compare (float16, GQA 32/8, D128) at VERIFY_SPECS
#             batch:cache_len:drafts against torch SDPA over the caches with the drafts written into
#             their free rows and torch eager on its ONNX graph (labelled: it copies the cache).
#             Lands in $OUT/verify.tar.gz, one report per shape
#   paged     issue 23: paged_attention's GPU tests (PAGED_TESTS=0: none), then its chunked prefill (float16, one sequence, GQA
#             32/8, D128, 16-key pages) at PAGED_SPECS q_len:context through `autofuse compare`
#             against torch eager and torch.compile of its ONNX graph (PAGED_BASELINES), and
#             flash_attention causal at q_len x the sequence's seeded length against torch SDPA (the
#             same attention over a contiguous cache). Lands in $OUT/paged.tar.gz
#   rope      issue 23: rope_qk's and masked_attention's GPU tests (ROPE_TESTS=0: none), then rope_qk (float16)
#             at ROPE_SPECS batch:heads:seq_k[:head_dim (128)[:seq_q (seq_k)]] through `autofuse compare`
#             against torch eager and torch.compile of its ONNX graph (ROPE_BASELINES). Lands in $OUT/rope.tar.gz
#   prefill-grid  issue 23: flash_attention (float16, 16 heads, D128) at seq 1024 (batch 8), 2048
#             (batch 8) and 4096 (batch 2), causal and not (PREFILL_SPECS: batch:seq:causal[:head_dim[:heads]] ...),
#             through `autofuse compare` against torch SDPA (PREFILL_BASELINES adds torch-compile,xla;
#             numpy's float64 reference bounds the shapes). Lands in $OUT/prefill-grid.tar.gz
#   gemm-sweep  issue 22: linear_bias_relu at the issue's shapes (GEMM_SHAPES m:n:k ...) in
#             GEMM_DTYPES (default float16 bfloat16), and the linear patterns (GEMM_PATTERNS) at
#             4096^3 in float16, through `autofuse compare` against torch eager and torch.compile
#             (GEMM_BASELINES names others for the shapes, e.g. adding xla,tvm-auto).
#             Lands in $OUT/gemm-sweep.tar.gz, one report per shape
#   real-models  issue 25: the corpus's fixed exports (REAL_VARIANTS, default dynamo-fixed) of
#             REAL_MODELS (default bert, gpt2, llama, vit, resnet18) re-exported in float16 on the GPU with their modules' torch.export
#             programs (models/real/export.py --programs), each through `autofuse compare MODEL
#             --torch-program` against torch eager and torch.compile of the module itself. Lands in
#             $OUT/real-models.tar.gz, one report per model
#   woq       issue 22: woq_matmul (float16, int4 weights, a scale per 128, n = k = 4096) at WOQ_TOKENS
#             (default 16 128 4096) tokens through `autofuse compare` against torch eager and
#             torch.compile of its ONNX graph (which dequantises all of W, then a cuBLAS GEMM);
#             with WOQ_TRIALS=N, the first N configurations of each shape searched into $DB first
#             and compared with those records (WOQ_BASELINES names others, e.g. adding xla,tvm-auto).
#             Lands in $OUT/woq.tar.gz, one report per shape
#   moe       issue 22: moe_gate_topk (float16, 8 experts, top-2) at MOE_SHAPES (default tokens 2048,
#             hidden 2048, inter 4096 and the pattern's default shape): its GPU tests, compare against
#             torch eager and torch.compile of its ONNX graph (which gathers a copy of an expert's
#             weights per row tile: more work, labelled), the SIMT template cuda_routed alone
#             (gpu_check_templates.py), and the first MOE_TRIALS (default 8) configurations of the
#             wgmma kernel template searched (gpu_tune_kernels.py); MOE_STEPS (default
#             tests,compare,routed,tune) picks the parts, MOE_BASELINES the contenders. Lands in $OUT/moe.tar.gz
#   hopper-tune  the wgmma GEMM kernel template of linear_bias_relu (float16, 4096^3) searched
#             (benchmarks/gpu_tune_kernels.py, every config of its space within TUNE_SECS, default
#             330, resumable through $DB),
#             then compared with its records against torch eager and torch.compile. Lands in
#             $OUT/hopper-tune.tar.gz (the database included)
# Every step has its own timeout, so a slow one cannot take the others' reports with it; a
# compare rewrites its report.json after every pattern, so a cut one keeps what it measured.
set -u
OUT=${OUT:-out}
DB=${DB:-/tmp/autofuse-db}
mkdir -p "$OUT"
COMPARE=(python3 -m autofuse.cli compare --target h200 --no-progress)
LINEAR=linear_bias_relu:m=2048,n=2048,k=2048
SWIGLU=swiglu_ffn:tokens=512,hidden=1024,inter=2816
SOFTMAX=softmax_dropout:rows=16384,cols=4096
ROWS=(--shape "$SOFTMAX" --shape layernorm_residual:rows=16384,hidden=4096 --shape gelu_add_layernorm:rows=16384,hidden=4096)

case "${1:-measure}" in
measure)
  # Knob order of cuda_tiled_epilogue: threads-y, outputs-y, threads-x, outputs-x (per thread),
  # k tile (in 2-float vectors), unroll. The default row is the template's current choice.
  timeout 100 python3 benchmarks/gpu_check_templates.py --patterns linear_bias_relu --templates cuda_tiled_epilogue \
    --shape "$LINEAR" --repeat 20 --out "$OUT/sweep-linear-float32.json" \
    --knobs 'cuda_tiled_epilogue=[[16],[4],[16],[4]]' --knobs 'cuda_tiled_epilogue=[[16],[8],[16],[8]]' \
    --knobs 'cuda_tiled_epilogue=[[16],[8],[16],[8],[4]]' --knobs 'cuda_tiled_epilogue=[[16],[8],[16],[8],[16]]' \
    --knobs 'cuda_tiled_epilogue=[[16],[8],[16],[4]]' --knobs 'cuda_tiled_epilogue=[[16],[4],[16],[8]]' \
    --knobs 'cuda_tiled_epilogue=[[8],[8],[16],[8]]' --knobs 'cuda_tiled_epilogue=[[16],[8],[32],[8]]' \
    --knobs 'cuda_tiled_epilogue=[null,null,null,null,null,64]'
  # cuda_two_gemms: the same six knobs for the gate/up kernel, then for the down kernel.
  timeout 90 python3 benchmarks/gpu_check_templates.py --patterns swiglu_ffn --shape "$SWIGLU" --repeat 20 \
    --out "$OUT/sweep-swiglu-float32.json" \
    --knobs 'cuda_two_gemms=[[8],[8]]' --knobs 'cuda_two_gemms=[[16],[4]]' --knobs 'cuda_two_gemms=[[8],[8],[16],[2]]' \
    --knobs 'cuda_two_gemms=[null,null,null,null,null,null,[8],[8]]' \
    --knobs 'cuda_two_gemms=[[8],[8],null,null,null,null,[8],[8]]'
  timeout 240 "${COMPARE[@]}" --db none --pattern softmax_dropout,layernorm_residual,gelu_add_layernorm,linear_bias_relu,swiglu_ffn \
    "${ROWS[@]}" --shape "$LINEAR" --shape "$SWIGLU" --repeat 20 --report "$OUT/compare-large-float32"
  timeout 150 "${COMPARE[@]}" --db none --pattern softmax_dropout,layernorm_residual,gelu_add_layernorm --dtype float16 \
    "${ROWS[@]}" --baselines tvm-auto,torch-eager,torch-compile,xla --repeat 20 --report "$OUT/compare-large-float16"
  ;;
tune)
  # Ours tuned (union space) and tvm-auto (generic space) with the same 16 trials, then compared.
  timeout 270 "${COMPARE[@]}" --db "$DB" --pattern linear_bias_relu --shape m=2048,n=2048,k=2048 --trials 16 \
    --baselines tvm-auto,torch-eager --repeat 20 --report "$OUT/compare-tuned-linear"
  timeout 270 "${COMPARE[@]}" --db "$DB" --pattern softmax_dropout --shape rows=16384,cols=4096 --trials 16 \
    --baselines tvm-auto,torch-compile --repeat 20 --report "$OUT/compare-tuned-softmax"
  ;;
check)
  # XLA on the three patterns it could not translate before; the row kernels that changed thread
  # counts (spec_accept at vocab 32000, softmax rows no power of two divides) and cuda_flash with
  # a padded last key tile, checked and timed; the attention patterns against SDPA in float16.
  timeout 120 "${COMPARE[@]}" --db none --pattern moe_gate_topk,int8_matmul_dequant,spec_accept \
    --baselines torch-compile,xla --repeat 30 --report "$OUT/compare-xla-float32"
  timeout 60 python3 benchmarks/gpu_check_templates.py --patterns spec_accept,softmax_dropout,flash_attention \
    --templates cuda_rows_then_batch,cuda_rows,cuda_rows_reread,cuda_flash --shape softmax_dropout:rows=4096,cols=1000 \
    --shape flash_attention:seq_q=1000,seq_kv=1000 --out "$OUT/check-uneven-float32.json"
  timeout 150 "${COMPARE[@]}" --db none --pattern flash_attention,cross_attention,gqa_decode_attention --dtype float16 \
    --baselines torch-eager,torch-compile,torch-sdpa,xla --repeat 30 --report "$OUT/compare-attention-float16"
  ;;
kernels)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/kernels.tar.gz" .' EXIT
  exec > >(tee "$OUT/kernels.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  steps=",${KERNEL_STEPS:-compare,tests,model},"
  [[ $steps == *,compare,* ]] && steps+="gemm,int8,attention,"
  extra=${KERNEL_BASELINES:+,$KERNEL_BASELINES} more=${KERNEL_EXTRA_SECS:-0}
  if [[ $steps == *,gemm,* ]]; then
  timeout $((130 + more)) "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern linear_bias_relu,swiglu_ffn \
    --shape linear_bias_relu:m=4096,n=4096,k=4096 --shape swiglu_ffn:tokens=4096,hidden=4096,inter=11008 \
    --baselines torch-eager,torch-compile,torch-sdpa$extra --repeat 10 --report "$work/compare-kernels-gemm-float16"
  fi
  if [[ $steps == *,int8,* ]]; then
  timeout $((70 + more)) "${COMPARE[@]}" "${commit[@]}" --db none --pattern int8_matmul_dequant \
    --shape int8_matmul_dequant:m=4096,n=4096,k=4096 \
    --baselines torch-eager,torch-compile$extra --repeat 10 --report "$work/compare-kernels-gemm-int8-float32"
  fi
  if [[ $steps == *,attention,* ]]; then
  timeout $((130 + more)) "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern flash_attention,gqa_decode_attention \
    --shape flash_attention:batch=8,heads=16,kv_heads=16,seq_q=2048,seq_kv=2048,head_dim=128,causal=0 \
    --shape gqa_decode_attention:batch=16,num_heads=32,num_kv_heads=8,head_dim=128,max_seq=4096,cache_len=4000 \
    --baselines torch-eager,torch-compile,torch-sdpa$extra --repeat 10 --report "$work/compare-kernels-attention-float16"
  fi
  if [[ $steps == *,tests,* ]]; then
  timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_kernel_templates_gpu.py --durations=20 \
    --junitxml="$work/kernel-templates-gpu.xml"
  fi
  if [[ $steps == *,model,* ]]; then
  models=$(mktemp -d)
  python3 models/make_models.py --only decoder_block --dtype float16 --out "$models"
  timeout 300 "${COMPARE[@]}" "${commit[@]}" --db none "$models/decoder_block-float16.onnx" \
    --baselines torch-eager,torch-compile --repeat 20 --report "$work/compare-decoder-block-float16"
  fi
  ;;
parity)
  work=$(mktemp -d) old=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/parity.tar.gz" .' EXIT
  exec > >(tee "$work/parity.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  tar -C "$old" -xzf "${OLD_TREE:-.gpuold/tree.tar.gz}"
  timeout 170 python3 "$old/benchmarks/gpu.py" --patterns linear_bias_relu,softmax_dropout,layernorm_residual \
    --contenders autofuse,torch-eager,torch-compile --repeat 20 --shape "$LINEAR" "${ROWS[@]:0:4}" \
    --out "$work/parity-gpu-py-float32.json"
  timeout 170 "${COMPARE[@]}" "${commit[@]}" --db none --pattern linear_bias_relu,softmax_dropout,layernorm_residual \
    --shape "$LINEAR" "${ROWS[@]:0:4}" --baselines torch-eager,torch-compile --repeat 20 \
    --report "$work/parity-compare-float32"
  ;;
decode-grid)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/decode-grid.tar.gz" .' EXIT
  exec > >(tee "$work/decode-grid.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  for cache in ${DECODE_CACHES:-1024 4096 16384 32768}; do
    for batch in ${DECODE_BATCHES:-1 16 64}; do
      timeout ${DECODE_TIMEOUT:-150} "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern gqa_decode_attention \
        --shape batch=$batch,num_heads=32,num_kv_heads=8,head_dim=128,max_seq=$cache,cache_len=$((cache - 1)) \
        --baselines "${DECODE_BASELINES:-torch-sdpa}" --repeat 20 --no-plots --report "$work/decode-b$batch-c$cache"
      tar -C "$work" -czf "$OUT/decode-grid.tar.gz" .  # kept if the call is cut
    done
  done
  ;;
verify)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/verify.tar.gz" .' EXIT
  exec > >(tee "$work/verify.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  [[ ${VERIFY_TESTS:-1} == 1 ]] && timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider \
    tests/test_kernel_templates_gpu.py -k "spec_verify or paged" --junitxml="$work/verify-gpu-tests.xml"
  # batch:cache_len:drafts (GQA 32/8, D128, max_seq the cache length rounded up to 1024)
  for spec in ${VERIFY_SPECS:-1:4000:8 16:4000:8 1:16000:8 4:4000:16}; do
    IFS=: read -r batch length drafts <<< "$spec"
    timeout ${VERIFY_TIMEOUT:-150} "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern spec_verify_attention \
      --shape batch=$batch,heads=32,kv_heads=8,head_dim=128,max_seq=$(( (length + 1023) / 1024 * 1024 )),cache_len=$length,k_draft=$drafts \
      --baselines "${VERIFY_BASELINES:-torch-sdpa,torch-eager}" --repeat 20 --no-plots --report "$work/verify-b$batch-c$length-k$drafts"
    tar -C "$work" -czf "$OUT/verify.tar.gz" .  # kept if the call is cut
  done
  ;;
paged)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/paged.tar.gz" .' EXIT
  exec > >(tee "$work/paged.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  [[ ${PAGED_TESTS:-1} == 1 ]] && timeout 200 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_kernel_templates_gpu.py -k paged \
    --junitxml="$work/paged-gpu-tests.xml"
  # q_len:context (one sequence, GQA 32/8, D128, 16-key pages): paged_attention's chunk against torch
  # on its ONNX graph (which gathers the whole table), then flash_attention causal over a contiguous
  # cache of the sequence's own length (make_inputs' seeded seq_lens[0]) against torch SDPA: the
  # same attention without the pages
  for spec in ${PAGED_SPECS:-1024:4096 2048:8192}; do
    IFS=: read -r q_len context <<< "$spec"
    shape=batch=1,q_len=$q_len,num_heads=32,num_kv_heads=8,head_dim=128,page_size=16,max_pages=$((context / 16)),num_pages=$((context / 16))
    length=$(python3 -c "from autofuse.registry import get_pattern; p = get_pattern('paged_attention')
print(p.make_inputs(p.resolve_shape(dict(kv.split('=') for kv in '$shape'.split(','))), 'float16', 0)[4][0])")
    timeout 150 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern paged_attention --shape "$shape" \
      --baselines "${PAGED_BASELINES:-torch-eager,torch-compile}" --repeat 20 --no-plots --report "$work/paged-q$q_len-c$context"
    timeout 120 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern flash_attention \
      --shape batch=1,heads=32,kv_heads=8,seq_q=$q_len,seq_kv=$length,head_dim=128,causal=1 \
      --baselines torch-sdpa --repeat 20 --no-plots --report "$work/contiguous-q$q_len-kv$length"
    tar -C "$work" -czf "$OUT/paged.tar.gz" .  # kept if the call is cut
  done
  ;;
rope)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/rope.tar.gz" .' EXIT
  exec > >(tee "$work/rope.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  [[ ${ROPE_TESTS:-1} == 1 ]] && timeout 150 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_kernel_templates_gpu.py -k "rope or masked" \
    --junitxml="$work/rope-masked-gpu-tests.xml"
  # batch:heads:seq_k[:head_dim (default 128)[:seq_q (default seq_k)]]
  for spec in ${ROPE_SPECS:-1:32:2048 1:32:4096}; do
    IFS=: read -r batch heads seq dim queries <<< "$spec"
    dim=${dim:-128} queries=${queries:-$seq}
    name=rope-b$batch-h$heads-s$seq$([[ $dim == 128 ]] || echo "-d$dim")$([[ $queries == "$seq" ]] || echo "-q$queries")
    timeout 150 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern rope_qk \
      --shape batch=$batch,heads=$heads,seq_q=$queries,seq_k=$seq,head_dim=$dim \
      --baselines "${ROPE_BASELINES:-torch-eager,torch-compile}" --repeat 20 --no-plots --report "$work/$name"
    tar -C "$work" -czf "$OUT/rope.tar.gz" .  # kept if the call is cut
  done
  ;;
prefill-grid)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/prefill-grid.tar.gz" .' EXIT
  exec > >(tee "$work/prefill-grid.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  # batch:seq:causal[:head_dim (default 128)[:heads (default 16)]]
  for spec in ${PREFILL_SPECS:-8:1024:0 8:1024:1 8:2048:1 2:4096:0 2:4096:1}; do
    IFS=: read -r batch seq causal dim heads <<< "$spec"
    dim=${dim:-128} heads=${heads:-16}
    timeout 120 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern flash_attention \
      --shape batch=$batch,heads=$heads,kv_heads=$heads,seq_q=$seq,seq_kv=$seq,head_dim=$dim,causal=$causal \
      --baselines "${PREFILL_BASELINES:-torch-sdpa}" --repeat 20 --no-plots \
      --report "$work/prefill-b$batch-h$heads-s$seq-c$causal-d$dim"
    tar -C "$work" -czf "$OUT/prefill-grid.tar.gz" .  # kept if the call is cut
  done
  ;;
gemm-sweep)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/gemm-sweep.tar.gz" .' EXIT
  exec > >(tee "$work/gemm-sweep.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  for dtype in ${GEMM_DTYPES:-float16 bfloat16}; do
    for spec in ${GEMM_SHAPES:-4096:4096:4096 8192:8192:8192 128:4096:4096 1024:4096:4096 4096:11008:4096 4096:4096:11008}; do
      IFS=: read -r m n k <<< "$spec"
      timeout 150 "${COMPARE[@]}" "${commit[@]}" --db none --dtype $dtype --pattern linear_bias_relu \
        --shape m=$m,n=$n,k=$k --baselines "${GEMM_BASELINES:-torch-eager,torch-compile}" --repeat 10 --no-plots \
        --report "$work/gemm-$dtype-$m-$n-$k"
      tar -C "$work" -czf "$OUT/gemm-sweep.tar.gz" .  # kept if the call is cut
    done
  done
  patterns=${GEMM_PATTERNS-linear,linear_bias,linear_bias_gelu,linear_bias_gelu_tanh}  # set empty: none
  if [[ -n $patterns ]]; then
    shapes=(); for p in ${patterns//,/ }; do shapes+=(--shape "$p:m=4096,n=4096,k=4096"); done
    timeout 240 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern "$patterns" "${shapes[@]}" \
      --baselines torch-eager,torch-compile --repeat 10 --no-plots --report "$work/linear-patterns-float16"
  fi
  ;;
real-models)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/real-models.tar.gz" --exclude "*.pt2" .' EXIT
  exec > >(tee "$work/real-models.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  # dynamo: the TorchScript exporter writes float16 BERT and GPT-2 that onnx's checker and
  # onnxruntime reject (a float32 residual into a float16 LayerNormalization)
  timeout 240 python3 models/real/export.py --only "${REAL_MODELS:-bert,gpt2,llama,vit,resnet18}" \
    --variants "${REAL_VARIANTS:-dynamo-fixed}" --dtype "${REAL_DTYPE:-float16}" --device cuda --programs \
    --out "$work/models"
  for model in "$work"/models/*.onnx; do
    stem=$(basename "$model" .onnx)
    timeout 150 "${COMPARE[@]}" "${commit[@]}" --db none "$model" --torch-program "${model%.onnx}.pt2" \
      --baselines "${REAL_BASELINES:-torch-eager,torch-compile}" --repeat 50 --no-plots --report "$work/$stem"
    tar -C "$work" -czf "$OUT/real-models.tar.gz" --exclude "*.pt2" .  # kept if the call is cut
  done
  ;;
hopper-tune)
  work=$(mktemp -d)
  trap 'cp -r "$DB" "$work/db"; tar -C "$work" -czf "$OUT/hopper-tune.tar.gz" .' EXIT
  exec > >(tee "$work/hopper-tune.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  GEMM=(--pattern linear_bias_relu --dtype float16 --shape m=4096,n=4096,k=4096)
  timeout $((${TUNE_SECS:-330} + 60)) python3 benchmarks/gpu_tune_kernels.py "${GEMM[@]}" "${commit[@]}" --db "$DB" \
    --trials "${TRIALS:-48}" --budget-secs "${TUNE_SECS:-330}" --out "$work/tune-linear-4096-float16.json"
  timeout 120 "${COMPARE[@]}" "${commit[@]}" --db "$DB" "${GEMM[@]}" --baselines torch-eager,torch-compile \
    --repeat 20 --report "$work/compare-tuned-linear-4096-float16"
  ;;
moe)
  work=$(mktemp -d)
  trap 'tar -C "$work" -czf "$OUT/moe.tar.gz" .' EXIT
  exec > >(tee "$work/moe.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  steps=",${MOE_STEPS:-tests,compare,routed,tune},"
  [[ $steps == *,tests,* ]] && timeout 150 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_kernel_templates_gpu.py -k moe \
    --junitxml="$work/moe-gpu-tests.xml"
  for shape in ${MOE_SHAPES:-tokens=2048,hidden=2048,inter=4096,experts=8,k=2 tokens=64,hidden=256,inter=512,experts=8,k=2}; do
    tag=$(echo "$shape" | tr -d 'a-z=' | tr ',' '-')
    [[ $steps == *,compare,* ]] && timeout 150 "${COMPARE[@]}" "${commit[@]}" --db none --dtype float16 --pattern moe_gate_topk --shape "$shape" \
      --baselines "${MOE_BASELINES:-torch-eager,torch-compile}" --repeat 20 --no-plots --report "$work/compare-moe-$tag"
    [[ $steps == *,routed,* ]] && timeout 90 python3 benchmarks/gpu_check_templates.py --patterns moe_gate_topk --dtype float16 --templates cuda_routed \
      --shape "moe_gate_topk:$shape" --repeat 20 --out "$work/routed-moe-$tag.json"
    [[ $steps == *,tune,* ]] && timeout 150 python3 benchmarks/gpu_tune_kernels.py --pattern moe_gate_topk --dtype float16 --shape "$shape" \
      "${commit[@]}" --db "$DB" --trials "${MOE_TRIALS:-8}" --budget-secs 100 --out "$work/tune-moe-$tag.json"
    tar -C "$work" -czf "$OUT/moe.tar.gz" .  # kept if the call is cut
  done
  ;;
woq)
  work=$(mktemp -d)
  exec > >(tee "$work/woq.log") 2>&1
  commit=(${AUTOFUSE_COMMIT:+--commit "$AUTOFUSE_COMMIT"})
  trap 'cp -r "$DB" "$work/db" 2>/dev/null; tar -C "$work" -czf "$OUT/woq.tar.gz" .' EXIT
  db=none
  for m in ${WOQ_TOKENS:-16 128 4096}; do
    shape="m=$m,n=4096,k=4096,group=128,bits=${WOQ_BITS:-4}"
    if [[ ${WOQ_TRIALS:-0} -gt 0 ]]; then  # the first configurations of the space (dequant_first among them)
      db=$DB
      timeout 150 python3 benchmarks/gpu_tune_kernels.py --pattern woq_matmul --dtype float16 --shape "$shape" \
        "${commit[@]}" --db "$DB" --trials "$WOQ_TRIALS" --budget-secs 100 --out "$work/tune-woq-m$m-float16.json"
    fi
    timeout 150 "${COMPARE[@]}" "${commit[@]}" --db "$db" --dtype float16 --pattern woq_matmul \
      --shape "woq_matmul:$shape" --baselines "${WOQ_BASELINES:-torch-eager,torch-compile}" \
      --repeat 20 --no-plots --report "$work/compare-woq-m$m-float16"
  done
  ;;
*)
  echo "usage: $0 measure|tune|check|kernels|parity|decode-grid|prefill-grid|paged|rope|gemm-sweep|real-models|hopper-tune|woq|moe" >&2
  exit 2
  ;;
esac
