source "$(dirname "$0")/common.sh"
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the stock run's wheel trap
(MEGATRON_CG_FARM_OUT=$F timeout 420 python3 -m pytest tests/functional/test_megatron_lm_script.py tests/functional/test_capture_lifecycle.py -k "megatron or contracts" -v -rs -p no:cacheprovider > $F/final_tests.log 2>&1; echo "final tests rc=$?" >> $F/final_tests.log) &
timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt --cg-preset tiny-gpt --cuda-graph-impl transformer_engine > $F/readme_launcher.log 2>&1; echo "readme launcher rc=$?"
grep -A5 "run report" $F/readme_launcher.log | head -5
timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt --cg-preset tiny-gpt --cuda-graph-impl transformer_engine --exit-interval 10 --cg-metrics-out $F/exit_interval.metrics.json > $F/exit_interval.log 2>&1; echo "exit-interval rc=$?"
grep -A5 "run report" $F/exit_interval.log | head -5; python3 -c "import json; m=json.load(open('$F/exit_interval.metrics.json')); print('metrics steps', m['lm loss']['end_step'])"
wait
grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=" $F/final_tests.log; grep -E "^E " $F/final_tests.log | head
python3 -c "import json; r=json.load(open('$F/lifecycle_lifecycle.json')); print({k: r[k] for k in r if k.startswith('static_inputs') or k=='overhead'})"
pack
