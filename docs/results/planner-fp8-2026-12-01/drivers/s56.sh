source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: allocator traces of TE's own graph pool under FP8 (the plan writes FP8 layers as bf16 there):
# the three FP8 farm cases on TE's path (traced while the farm runs them), and a 4 x 1024 seq 2048 model
# in bf16, FP8 delayed, FP8 tensorwise (whole layer and attn), and FP8 dot-product attention (a user script).
export MEGATRON_CG_FARM_TIMEOUT_S=280
T="python3 -m pytest -q -rs -p no:cacheprovider"
TP=$PWD/docs/results/planner-fp8-2026-12-01/drivers/trace:$PYTHONPATH
mkdir -p $F/traces
case_run() { (MEMTRACE_DIR=$F/traces/$1 PYTHONPATH=$TP MEGATRON_CG_FARM_OUT=$F/farm-$1 timeout 300 $T tests/functional/test_farm.py -k "$1" > $F/farm_$1.log 2>&1; echo "farm $1 rc=$?" >> $F/rc.txt) & }
case_run tiny_gpt_fp8_delayed
case_run tiny_gpt_fp8_tensorwise
case_run tiny_gpt_fp8_attention_user_script
M="--cg-preset tiny-gpt --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32000 --train-iters 4 --cuda-graph-impl transformer_engine"
D8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
T8="--fp8-format hybrid --fp8-recipe tensorwise"
trace() { name=$1; shift; MEMTRACE_DIR=$F/traces/$name PYTHONPATH=$TP timeout 150 "$@" --cg-report-out $F/traces/$name.report.json > $F/traces/$name.log 2>&1; echo "trace $name rc=$?" >> $F/rc.txt; }
L="python3 -m megatron_cg_plugin.pretrain_gpt"
(
trace bf16_layer $L $M
trace fp8d_layer $L $M $D8
trace fp8t_layer $L $M $T8
trace fp8d_attn $L $M $D8 --cuda-graph-modules attn
trace fp8t_attn $L $M $T8 --cuda-graph-modules attn
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 trace fp8da_layer python3 -m megatron_cg_plugin.launch.run_script tests/functional/_scripts/user_pretrain_gpt_fp8_attention.py $M $D8
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 trace bf16nd_layer $L $M
) &
wait
cat $F/rc.txt
for c in tiny_gpt_fp8_delayed tiny_gpt_fp8_tensorwise tiny_gpt_fp8_attention_user_script; do tail -n 1 $F/farm_$c.log; grep -h "Error\|mismatch" $F/farm_$c.log | cut -c1-300 | head -3; done
for f in $F/traces/*.report.json $F/farm-*/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','pool_bytes','failure')}, {k: r.get(k) for k in ('predicted_pool_bytes',)})" 2>&1 | tail -1; done
for n in $F/traces/*.log; do grep -h "Error" $n | tail -2; done
ls -la $F/traces/*/ | head -30
mkdir -p $F/farm; for d in $F/farm-*; do cp $d/*summary.json $d/*graphed.report.json $F/farm/ 2>/dev/null; done; rm -rf $F/farm-*
pack
