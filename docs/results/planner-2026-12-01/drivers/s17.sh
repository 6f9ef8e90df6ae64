source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: capture phases (where the plugin's capture time goes), the routers' measured drops in the farm's MoE cases.
C=tests/functional/test_cases; G="--cuda-graph-impl transformer_engine"
mkdir -p $F/phases
run() { name=$1; shift; timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt "$@" $G --train-iters 5 --cg-report-out $F/phases/$name.report.json > $F/phases/$name.log 2>&1; echo "phases $name rc=$?" >> $F/rc.txt; }
run gpt4 --cg-preset tiny-gpt --num-layers 4
run dense1b --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768
run moe --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity
export MEGATRON_CG_FARM_TIMEOUT_S=200
farm() { name=$1; shift; timeout 330 python3 -m megatron_cg_plugin.cli farm --out $F/farm/$name "$@" > $F/farm_$name.log 2>&1; echo "farm $name rc=$?" >> $F/rc.txt; }
farm a $C/moe/tiny_moe_droppad $C/moe/tiny_moe_router &
farm b $C/moe/tiny_moe_real_data_spm &
wait
cat $F/rc.txt
grep -h "capture phases\|graph pool: predicted" $F/phases/*.log
for f in $F/farm_*.log; do echo "== $f"; grep -E "^== |PASS|FAIL|^\|" $f | cut -c1-300; done
pack
