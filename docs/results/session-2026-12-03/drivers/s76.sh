source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s76, side by side on one GPU (no step time here is a comparison of the farm's):
# (1) issue 32: the farm's single-GPU cases on the refactored code against their golden values (gpt_6p7b left out:
#     78 GB beside the rest); the FP8 5x2048 case also checks issue 30's planner fix (684 predicted vs 620) and the
#     slot teardown fix (report: after-teardown bytes);
# (2) issue 30: megatron-cg matrix bench, plugin / stock per non-refused cell (block schedule, 4 rounds x 6 steps,
#     3 benches side by side, beside the farm: shared-GPU figures);
# (3) issue 34: the packed-sequence farm cases gpt_4x2048_{docmask,sft}_{layer,attn}_megatron_lm, eager vs graphed,
#     writing their golden values (their first run).
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
C=docs/results/exact-matrix-2026-12-02
( export MEGATRON_CG_FARM_TIMEOUT_S=420 MEGATRON_CG_FARM_OUT=$F/farm
  timeout 500 python3 -m pytest -q -rs -p no:cacheprovider -n 5 tests/functional/test_farm.py -k "not 6p7b and not 4x2048" > $F/farm.log 2>&1
  echo "farm rc=$?" >> $F/rc.txt ) &
( python3 -c "import transformers, datasets; print('sft imports: transformers', transformers.__version__, 'datasets', datasets.__version__)" >> $F/gpu.txt 2>&1
  export MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/packed MEGATRON_CG_FARM_TIMEOUT_S=420
  timeout 500 python3 -m pytest -q -rs -p no:cacheprovider -n 2 tests/functional/test_farm.py -k "4x2048 and not cp2" > $F/packed.log 2>&1
  echo "packed farm rc=$?" >> $F/rc.txt; mkdir -p $F/golden
  for c in tests/functional/test_cases/gpt/gpt_4x2048_*; do
    [ -f $c/golden_values_dev_dgx_h200.json ] && cp $c/golden_values_dev_dgx_h200.json $F/golden/$(basename $c).json; done ) &
( unset NVTE_ALLOW_NONDETERMINISTIC_ALGO; sleep 20
  timeout -k 10 480 python3 -m megatron_cg_plugin.cli matrix bench $C/cells.json --out $F/bench --parallel 3 --timeout-s 300 \
    -- --bench-rounds 4 --bench-steps 6 > $F/bench.log 2>&1; echo "matrix bench rc=$?" >> $F/rc.txt ) &
wait
cat $F/rc.txt; tail -25 $F/farm.log | cut -c1-300; tail -25 $F/bench.log | cut -c1-300; tail -12 $F/packed.log | cut -c1-300
python3 -m megatron_cg_plugin.cli matrix render $C/cells.json $C/s68/matrix.json $C/s69/matrix.json \
  docs/results/open-issues-2026-12-02/s70/matrix.json $F/bench/matrix-bench.json > $F/support-matrix.md 2>$F/render.err
mkdir -p $F/reports; cp $F/farm/*.report.json $F/reports/ 2>/dev/null
grep -h "after teardown\|teardown" $F/farm/gpt_5x2048*.report.json 2>/dev/null | head -5
cp $F/packed/*.report.json $F/reports/ 2>/dev/null
rm -rf $F/farm/*.logs $F/farm/data $F/packed/*.logs $F/packed/data $F/bench/*/data; pack
