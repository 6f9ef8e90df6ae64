source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14 on GPT-3 6.7B's shape (32 x 4096), one GPU: eager == graphed with the attention groups offloaded between
# replays through a user's script on the synthetic indexed dataset (the farm case's golden values written by this
# run), then the bench over 4 rounds: slot without offload, between-replays copies, and Megatron's own offload with
# TE's graphs.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=220
C=gpt_6p7b_slot_offload_staged_user_script
MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?"
tail -n 3 $F/farm_$C.log; grep -h "Error\|mismatch\|differs" $F/farm_$C.log | cut -c1-300 | head -5
cp tests/functional/test_cases/gpt/$C/golden_values_dev_dgx_h200.json $F/ 2>/dev/null
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print({k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_host_arena_bytes','predicted_pool_bytes')})"; done
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
G67="--cg-preset tiny-gpt --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16"
timeout 280 $B --bench-rounds 4 --bench-steps 5 --bench-out $F/bench-67b --bench-arms slot,slot-offload-staged-w1,stock $G67 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp $OFF > $F/bench-67b.log 2>&1; echo "bench 6.7b rc=$?"
sed -n '/^| arm/,$p' $F/bench-67b/bench.md | head -30; grep -h "Error" $F/bench-67b.log | tail -3
rm -rf $F/farm/data; pack
