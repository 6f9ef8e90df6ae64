source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s81 (issue 34, correctness; 1x H200, deterministic): the four single-GPU packed farm cases with --cg-thd-max-seqlen
# (s80: above N x heads x L^2 = 2^30 TE's deterministic THD attention leaves cuDNN for unfused attention), writing
# their golden values; beside them the packed functional test, and stock Megatron eager (pretrain_gpt.py, the farm's
# eager flags without the plugin's) on both data sets, whose printed lm loss must equal the plugin's eager run's.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .sftwheels/*.whl >> $F/gpu.txt 2>&1
python3 -c "import transformers, datasets; print('sft imports ok')" >> $F/gpu.txt 2>&1
( MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_FARM_TIMEOUT_S=400 timeout 500 \
    python3 -m pytest tests/functional/test_farm.py -k "4x2048 and not cp2" -n 2 -rs -q -p no:cacheprovider > $F/farm.log 2>&1
  echo "farm rc=$?" >> $F/rc.txt
  mkdir -p $F/golden; for c in tests/functional/test_cases/gpt/gpt_4x2048_*; do
    [ -f $c/golden_values_dev_dgx_h200.json ] && cp $c/golden_values_dev_dgx_h200.json $F/golden/$(basename $c).json; done ) &
( MEGATRON_CG_FARM_OUT=$F/functional timeout 400 python3 -m pytest tests/functional/test_packed_graphs_gpu.py -rs -q \
    -p no:cacheprovider > $F/functional.log 2>&1; echo "functional rc=$?" >> $F/rc.txt ) &
export F
stock_flags() { python3 docs/results/session-2026-12-03b/drivers/stock_flags.py "$1"; }  # the case without the plugin's flags
port=29760
for data in docmask sft; do
  stock_flags gpt_4x2048_${data}_layer_megatron_lm > $F/${data}_stock_flags.txt 2>> $F/flags.err
  port=$((port + 1))
  ( RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 400 \
      python3 $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/${data}_stock_flags.txt) > $F/${data}_stock_eager.log 2>&1
    echo "$data stock eager rc=$?" >> $F/rc.txt ) &
done
wait
python3 - > $F/compare.txt 2>&1 <<'PY'
import glob, os, re
from pathlib import Path
F = Path(os.environ["F"])
line = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
for data in ("docmask", "sft"):
    stock = dict(line.findall((F / f"{data}_stock_eager.log").read_text())) if (F / f"{data}_stock_eager.log").exists() else {}
    for module in ("layer", "attn"):
        for mode in ("eager", "graphed"):
            text = "".join(p.read_text(errors="replace") for p in (F / "farm" / f"gpt_4x2048_{data}_{module}_megatron_lm.{mode}.logs").rglob("stdout.log"))
            plugin = dict(line.findall(text))
            print(f"{data} {module} plugin {mode} ({len(plugin)} steps) == stock eager ({len(stock)} steps):",
                  bool(plugin) and plugin == stock, "first differing:",
                  next(((k, plugin[k], stock.get(k)) for k in sorted(plugin, key=int) if plugin[k] != stock.get(k)), None))
PY
cat $F/rc.txt $F/compare.txt; tail -n 4 $F/farm.log $F/functional.log | cut -c1-300
grep -h "FAILED\|Error" $F/farm.log | head -6 | cut -c1-400
rm -rf $F/stock/data $F/farm/data $F/functional/packed_graphs/data $F/farm/*.pt
pack
