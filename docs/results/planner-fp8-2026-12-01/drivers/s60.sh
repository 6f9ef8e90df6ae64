source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: gpt_1b_slot_offload_user_script lost eager == graphed once in six runs (s57, five other GPU jobs
# beside it). Four copies at once here, to see whether load brings it back.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=240
T="python3 -m pytest -q -rs -p no:cacheprovider"
for k in 1 2 3 4; do (MEGATRON_CG_FARM_OUT=$F/farm-$k timeout 250 $T tests/functional/test_farm.py -k gpt_1b_slot_offload_user_script > $F/farm_$k.log 2>&1; echo "copy $k rc=$?" >> $F/rc.txt) & done
wait
cat $F/rc.txt
for k in 1 2 3 4; do tail -n 1 $F/farm_$k.log; grep -h "differs\|Error" $F/farm_$k.log | cut -c1-500 | head -2; done
mkdir -p $F/farm; for d in $F/farm-*; do mkdir -p $F/farm/$(basename $d); cp $d/*summary.json $F/farm/$(basename $d)/ 2>/dev/null; done; rm -rf $F/farm-*
pack
