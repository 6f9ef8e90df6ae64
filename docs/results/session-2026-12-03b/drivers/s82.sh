source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s82 (issue 34): s81's two runs that ran out of memory beside the rest (cuDNN's deterministic THD backward asked
# 16-32 GiB of workspace in each process): the farm case gpt_4x2048_docmask_attn_megatron_lm, and stock Megatron
# eager on the SFT data (the farm's eager flags without the plugin's), side by side, nothing else on the GPU.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .sftwheels/*.whl >> $F/gpu.txt 2>&1
( MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_FARM_TIMEOUT_S=200 timeout 290 \
    python3 -m pytest tests/functional/test_farm.py -k "docmask_attn" -rs -q -p no:cacheprovider > $F/farm.log 2>&1
  echo "farm rc=$?" >> $F/rc.txt; mkdir -p $F/golden
  cp tests/functional/test_cases/gpt/gpt_4x2048_docmask_attn_megatron_lm/golden_values_dev_dgx_h200.json $F/golden/gpt_4x2048_docmask_attn_megatron_lm.json ) &
export F
python3 docs/results/session-2026-12-03b/drivers/stock_flags.py gpt_4x2048_sft_layer_megatron_lm > $F/sft_stock_flags.txt 2>> $F/flags.err
RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29791 timeout 280 \
  python3 $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/sft_stock_flags.txt) > $F/sft_stock_eager.log 2>&1
echo "sft stock eager rc=$?" >> $F/rc.txt
wait
cat $F/rc.txt; tail -n 2 $F/farm.log | cut -c1-300; grep -c "lm loss" $F/sft_stock_eager.log
rm -rf $F/stock/data $F/farm/data; pack
