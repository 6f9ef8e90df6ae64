source "$(dirname "$0")/common.sh"
# The README's first GPU command, verbatim, one process, no torchrun.
timeout 180 python3 -m megatron_cg_plugin.pretrain_gpt --cg-preset tiny-gpt --cuda-graph-impl transformer_engine > $F/readme_launcher.log 2>&1
echo "readme launcher rc=$?"; grep -A8 "run report" $F/readme_launcher.log; grep -iE "error|Traceback" $F/readme_launcher.log | head -5
# Megatron-LM's own pretrain_gpt.py, in the background beside the farm.
(MEGATRON_CG_FARM_OUT=$F timeout 480 python3 -m pytest tests/functional/test_megatron_lm_script.py -v -rs -p no:cacheprovider > $F/megatron_lm.log 2>&1; echo "megatron-lm rc=$?" >> $F/megatron_lm.log) &
MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F timeout 400 python3 -m pytest tests/functional/test_farm.py -k "real_data or 12x1024" -n 3 -v -rs -p no:cacheprovider > $F/new_cases.log 2>&1
echo "new cases rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $F/new_cases.log | tail -12
wait
tail -8 $F/megatron_lm.log
pack
