#!/usr/bin/env bash
# One device-tool call's worth of GPU measurement (under 10 minutes on one H200), run from a
# snapshot of the repository on the GPU machine after TVM's bundle is unpacked there
# (../shared/gpu/tvm-bundle.sh, two calls). Writes JSON under $OUT; commit it under
# benchmarks/results/h200/.
#   every pattern's CUDA templates checked against numpy (float32, default shapes);
#   gpu.py on the patterns whose templates have not been timed yet;
#   the models built for CUDA with and without CUDA graphs, checked against onnxruntime;
#   a first tuning run on the GPU (softmax_dropout at an LLM-scale shape, 16 trials).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
NEW=cross_attention,gqa_decode_attention,paged_attention,rope_qk,conv2d_bn_relu,moe_gate_topk,int8_matmul_dequant,sparse24_matmul_gather,spec_accept,spec_verify_attention
timeout 140 python3 benchmarks/gpu_check_templates.py --patterns all --dtype float32 --out "$OUT/check-all-float32.json"
timeout 170 python3 benchmarks/gpu.py --patterns "$NEW" --repeat 30 --budget-secs 140 --out "$OUT/gpu-new-float32.json"
timeout 140 python3 benchmarks/gpu_models.py --models mlp,transformer_block,decoder_block --repeat 50 --out "$OUT/gpu-models.json"
timeout 100 python3 benchmarks/gpu.py --patterns softmax_dropout --shape softmax_dropout:rows=16384,cols=4096 --trials 16 \
  --contenders autofuse,tvm-auto,torch-compile --repeat 20 --out "$OUT/gpu-tuned-softmax.json"
