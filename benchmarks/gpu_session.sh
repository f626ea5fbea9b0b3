#!/usr/bin/env bash
# One device-tool call's worth of GPU measurement (each stage under 10 minutes on one H200), run
# from a snapshot of the repository on the GPU machine after TVM's bundle is unpacked there
# (../shared/gpu/tvm-bundle.sh, two calls). Writes JSON under $OUT; commit it under
# benchmarks/results/h200/.
#   bash benchmarks/gpu_session.sh measure   GEMM tile sweeps, then the patterns at LLM-scale
#                                            shapes in float32 (and the row patterns in float16)
#   bash benchmarks/gpu_session.sh tune      first tuning on the GPU: 16 trials each of
#                                            linear_bias_relu and softmax_dropout, large shapes
#   bash benchmarks/gpu_session.sh check     XLA-GPU on the patterns it gained ops for; the
#                                            templates changed since (uneven rows, padded keys)
# Every step has its own timeout, so a slow one cannot take the others' JSON with it.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
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
  timeout 200 python3 benchmarks/gpu.py --patterns softmax_dropout,layernorm_residual,gelu_add_layernorm,linear_bias_relu,swiglu_ffn \
    "${ROWS[@]}" --shape "$LINEAR" --shape "$SWIGLU" --repeat 20 --budget-secs 170 --out "$OUT/gpu-large2-float32.json"
  timeout 120 python3 benchmarks/gpu.py --patterns softmax_dropout,layernorm_residual,gelu_add_layernorm --dtype float16 \
    "${ROWS[@]}" --contenders autofuse,tvm-auto,torch-eager,torch-compile,xla-gpu --repeat 20 --budget-secs 90 \
    --out "$OUT/gpu-large-float16.json"
  ;;
tune)
  timeout 270 python3 benchmarks/gpu.py --patterns linear_bias_relu --shape "$LINEAR" --trials 16 \
    --contenders autofuse,torch-eager --repeat 20 --out "$OUT/gpu-tuned-linear.json"
  timeout 270 python3 benchmarks/gpu.py --patterns softmax_dropout --shape "$SOFTMAX" --trials 16 \
    --contenders autofuse,tvm-auto,torch-compile --repeat 20 --out "$OUT/gpu-tuned-softmax.json"
  ;;
check)
  # The XLA baseline on the three patterns it could not translate before; the row kernels that
  # changed thread counts (spec_accept at vocab 32000, softmax rows no power of two divides) and
  # cuda_flash with a padded last key tile, checked and timed.
  timeout 80 python3 benchmarks/gpu.py --patterns moe_gate_topk,int8_matmul_dequant,spec_accept \
    --contenders autofuse,torch-compile,xla-gpu --repeat 30 --out "$OUT/gpu-xla-float32.json"
  timeout 60 python3 benchmarks/gpu_check_templates.py --patterns spec_accept,softmax_dropout,flash_attention \
    --templates cuda_rows_then_batch,cuda_rows,cuda_rows_reread,cuda_flash --shape softmax_dropout:rows=4096,cols=1000 \
    --shape flash_attention:seq_q=1000,seq_kv=1000 --out "$OUT/check-uneven-float32.json"
  ;;
*)
  echo "usage: $0 measure|tune|check" >&2
  exit 2
  ;;
esac
