source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 30: (1) the four matrix cells that died in s66, again, keeping each run's stderr; (2) the realistic MoE
# farm cases (drop-and-pad attn moe, dropless attn moe_router moe_preprocess) with the planner's new MoE terms,
# golden values written by this run; (3) the FP8 current-scaling farm case again, under the allocator trace (its
# slot pool was predicted 1.30x), and the backward-capture labels of helper-a's tracker exercised by every capture.
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
export MEGATRON_CG_FARM_TIMEOUT_S=330
T="python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py"
( timeout 400 python3 -m megatron_cg_plugin.cli matrix run $M/cells.json --out $F/matrix --jobs 4 --only moedroppad_moe_fp8tensorwise_slot_1 moedroppad_layer_fp8delayed_slotoffload_1 moedropless_attn_fp8delayed_slot_1 gpt_layer_bf16_slotoffload_1 > $F/matrix.log 2>&1; echo "matrix rc=$?" >> $F/rc.txt ) &
for C in moe_8x2048_droppad_megatron_lm moe_8x2048_dropless_megatron_lm; do
  ( MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm timeout 400 $T -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?" >> $F/rc.txt
    cp tests/functional/test_cases/moe/$C/golden_values_dev_dgx_h200.json $F/golden_$C.json 2>/dev/null ) &
done
( C=gpt_5x2048_slot_fp8_tensorwise_megatron_lm
  MEMTRACE_DIR=$F/traces PYTHONPATH=$D/trace:$PYTHONPATH MEGATRON_CG_FARM_OUT=$F/farm timeout 400 $T -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?" >> $F/rc.txt ) &
wait
cat $F/rc.txt; grep -h ": exact\|: differs\|: failed\|: refused" $F/matrix.log
for f in $F/farm_*.log; do echo "== $f"; tail -n 2 $f | cut -c1-400; grep -h "^E  " $f | head -4 | cut -c1-400; done
mkdir -p $F/logtails
for d in $F/matrix/*.logs $F/farm/*.logs; do n=$(basename $d .logs); for s in stdout stderr; do f=$(ls $d/*/attempt_0/0/$s.log 2>/dev/null | head -1); [ -n "$f" ] && tail -c 5000 $f > $F/logtails/$n.$s.txt; done; done
for f in $F/logtails/*graphed.stderr.txt; do grep -l "Error\|error" $f >/dev/null && { echo "== $f"; grep -h "Error\|error:" $f | tail -4 | cut -c1-400; }; done
rm -rf $F/matrix/*.logs $F/matrix/data $F/farm/*.logs $F/farm/data
pack
