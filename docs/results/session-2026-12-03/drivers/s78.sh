source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s78: s76's gpt_1b_slot_offload_user_script (in-graph offload, 16 x 2048) trained differently from eager and from its
# golden values from step 3, while 5 farm workers and 3 benches shared the GPU. Alone here; then the three single-GPU
# cases s76's timeout cut off.
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_FARM_TIMEOUT_S=160
timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k gpt_1b_slot_offload_user_script > $F/farm_1b.log 2>&1
echo "1b alone rc=$?" >> $F/rc.txt
MEGATRON_CG_FARM_TIMEOUT_S=70 timeout 80 python3 -m pytest -q -rs -p no:cacheprovider -n 3 tests/functional/test_farm.py \
  -k "tiny_moe_slot_offload or tiny_moe_real_data_spm" > $F/farm_rest.log 2>&1; echo "rest rc=$?" >> $F/rc.txt
cat $F/rc.txt; tail -3 $F/farm_1b.log | cut -c1-300; tail -3 $F/farm_rest.log | cut -c1-300
rm -rf $F/farm/*.logs $F/farm/data; pack
