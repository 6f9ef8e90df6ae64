source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: host profile of stock and plugin on the Llama-like model (cached batches), for --host-diff.
# Issue 14: the 1B with every attention group offloaded: in-graph copies against copies between replays, one process.
export NVTE_CPU_OFFLOAD_V1=1
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
L="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine"
timeout 170 $B --bench-cached-batches 4 --bench-rounds 12 --bench-steps 4 --bench-skip-steps 1 --bench-arms stock,plugin --bench-profile-dir $F/llama-prof --bench-out $F/bench-llama-prof $L > $F/bench-llama-prof.log 2>&1; echo "bench llama rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-llama-prof/bench.md; grep "^| stock\|^| plugin" $F/bench-llama-prof/bench.md | head -2
python3 -m megatron_cg_plugin.bench_output --host-diff $F/llama-prof plugin stock 2>&1 | head -30
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
timeout 260 $B --bench-rounds 2 --bench-steps 6 --bench-out $F/bench-1b-staged --bench-arms slot,slot-offload,slot-offload-staged $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm > $F/bench-1b-staged.log 2>&1; echo "bench 1b rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b-staged/bench.md | head -30; grep -h "Error" $F/bench-1b-staged.log | tail -3
pack
