source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: is the Llama-like plugin / stock gap of s51 (1.06, n=20) the contract check? Three arms in one process:
# stock, plugin (full check), plugin-no-check; 30 rounds of 4 steps on cached batches.
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
L="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine"
timeout 420 $B --bench-cached-batches 4 --bench-rounds 30 --bench-steps 4 --bench-skip-steps 1 --bench-arms stock,plugin,plugin-no-check --bench-out $F/bench-llama-check $L > $F/bench-llama-check.log 2>&1; echo "bench llama rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-llama-check/bench.md; grep "^| stock\|^| plugin" $F/bench-llama-check/bench.md | head -3; grep -h "Error" $F/bench-llama-check.log | tail -3
pack
