source "$(dirname "$0")/common.sh"
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the stock run's wheel trap
(MEGATRON_CG_FARM_OUT=$F timeout 420 python3 -m pytest tests/functional/test_megatron_lm_script.py tests/functional/test_thd_partition.py -v -rs -p no:cacheprovider > $F/megatron_lm.log 2>&1; echo "megatron-lm rc=$?" >> $F/megatron_lm.log) &
# README's real-data commands, verbatim.
(python -m megatron_cg_plugin.testing.datasets /tmp/mcg-data > $F/readme_data.log 2>&1 && timeout 200 python -m megatron_cg_plugin.pretrain_gpt --cg-preset tiny-gpt --cuda-graph-impl transformer_engine \
    --data-path /tmp/mcg-data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 >> $F/readme_data.log 2>&1; echo "readme data rc=$?" >> $F/readme_data.log) &
MEGATRON_CG_FARM_OUT=$F timeout 420 python3 -m pytest tests/functional/test_farm.py tests/functional/test_capture_lifecycle.py -n 3 -v -rs -p no:cacheprovider -k "tiny_gpt_layer or gpt_12x1024_layer or tiny_gpt_real_data or gpt_12x1024_attn_user_script or tiny_moe_router or contracts" > $F/regressions.log 2>&1
echo "regressions rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $F/regressions.log | tail -14
wait
grep -E "readme data rc|NullTokenizer data|SentencePiece data" $F/readme_data.log; grep -A5 "run report" $F/readme_data.log | head -6
grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=" $F/megatron_lm.log; grep -E "^E " $F/megatron_lm.log | head -20
pack
