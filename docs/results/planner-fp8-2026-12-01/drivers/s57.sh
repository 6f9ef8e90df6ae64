source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: the held-out FP8 configurations on TE's capture path (PREDICTION_heldout.txt, committed first).
# Issue 14: in-graph offload now follows Megatron's choice across the layers (the last layer keeps its groups):
# the slot-offload farm cases (eager == graphed, golden values, arenas predicted vs measured), then the 1B bench
# over in-graph and between-replays copies (windows 1 and 3) in one process.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=280
T="python3 -m pytest -q -rs -p no:cacheprovider"
case_run() { (MEGATRON_CG_FARM_OUT=$F/farm-$1 timeout 330 $T tests/functional/test_farm.py -k "$1" > $F/farm_$1.log 2>&1; echo "farm $1 rc=$?" >> $F/rc.txt) & }
for c in tiny_gpt_slot_offload tiny_moe_slot_offload tiny_gpt_slot_fp8_offload gpt_12x1024_slot_offload_user_script gpt_1b_slot_offload_user_script; do case_run $c; done
D8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"; T8="--fp8-format hybrid --fp8-recipe tensorwise"
G="--cuda-graph-impl transformer_engine --train-iters 3"
LL="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512"
B1="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
G12="--cg-preset tiny-gpt --num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000"
S6="--cg-preset tiny-gpt --num-layers 6 --hidden-size 1536 --ffn-hidden-size 4096 --num-attention-heads 12 --group-query-attention --num-query-groups 4 --swiglu --disable-bias-linear --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32000"
H5="--cg-preset tiny-gpt --num-layers 6 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32000"
mkdir -p $F/heldout
held() { name=$1; shift; timeout 150 "$@" $G --cg-report-out $F/heldout/$name.report.json > $F/heldout/$name.log 2>&1; echo "heldout $name rc=$?" >> $F/rc.txt; }
L="python3 -m megatron_cg_plugin.pretrain_gpt"
(
held H1_llama_fp8d $L $LL $D8
held H2_1b_fp8t_ends $L $B1 $T8 --first-last-layers-bf16 --num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 1
held H3_12x1024_fp8d_attn $L $G12 $D8 --cuda-graph-modules attn
held H4_swiglu_gqa_fp8t $L $S6 $T8
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 held H5_fp8_attention python3 -m megatron_cg_plugin.launch.run_script tests/functional/_scripts/user_pretrain_gpt_fp8_attention.py $H5 $D8
) &
wait
cat $F/rc.txt
for c in tiny_gpt_slot_offload tiny_moe_slot_offload tiny_gpt_slot_fp8_offload gpt_12x1024_slot_offload_user_script gpt_1b_slot_offload_user_script; do echo "== $c"; tail -n 2 $F/farm_$c.log; grep -h "Error\|mismatch\|differs\|assert" $F/farm_$c.log | cut -c1-300 | head -4; done
for f in $F/heldout/*.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','pool_bytes','failure')}, r.get('predicted_pool_bytes'), r.get('prediction_leaves_out'))" 2>&1 | tail -1; done
for f in $F/farm-*/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_host_arena_bytes','predicted_pool_bytes')})"; done
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="$B1 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
timeout 240 $B --bench-rounds 2 --bench-steps 6 --bench-out $F/bench-1b --bench-arms slot,slot-offload-w1,slot-offload-staged-w1,slot-offload-staged-w3 $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm > $F/bench-1b.log 2>&1; echo "bench 1b rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b/bench.md | head -40; grep -h "Error" $F/bench-1b.log | tail -3
mkdir -p $F/farm; for d in $F/farm-*; do cp $d/*summary.json $d/*graphed.report.json $F/farm/ 2>/dev/null; done; rm -rf $F/farm-*
pack
