source "$(dirname "$0")/common.sh"
# The stock run needs the wheel's packaging trap fixed on the host, as every wheel user must: Megatron's
# initialize runs `make` in megatron/core/datasets, where the wheel ships helpers_cpp but no Makefile.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
(MEGATRON_CG_FARM_OUT=$F timeout 500 python3 -m pytest tests/functional/test_megatron_lm_script.py -v -rs -p no:cacheprovider > $F/megatron_lm.log 2>&1; echo "megatron-lm rc=$?" >> $F/megatron_lm.log) &
# README: megatron-cg run with Megatron-LM's script and a preset, verbatim but for the entry point
(cd .megatron-lm && timeout 200 python3 -m megatron_cg_plugin.cli run pretrain_gpt.py --cg-preset tiny-gpt --cuda-graph-impl transformer_engine > $F/readme_run.log 2>&1; echo "readme run rc=$?" >> $F/readme_run.log) &
MEGATRON_CG_FARM_OUT=$F timeout 460 python3 -m pytest tests/functional/test_farm.py tests/functional/test_capture_lifecycle.py -n 3 -v -rs -p no:cacheprovider -k "tiny_gpt_attn or tiny_gpt_layer or tiny_moe_router or tiny_moe_droppad or contracts or stale" > $F/regressions.log 2>&1
echo "regressions rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $F/regressions.log | tail -14
wait
tail -4 $F/readme_run.log; grep -A6 "run report" $F/readme_run.log
grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=" $F/megatron_lm.log
grep -E "^E " $F/megatron_lm.log | head -20
pack
