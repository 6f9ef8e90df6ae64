source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s74a (issue 34, correctness; one call on 1x H200, ~8 min, up to 10 processes on the GPU at once): (1) what stock Megatron and the plugin do with
# --dataloader-inter-document-masking and --sft under TE graphs, whole layer and attn, through Megatron-LM's own
# pretrain_gpt.py: stock eager / stock graphed (expected: the replay assert) / the plugin without --cg-thd-max-seqs
# (expected: refused by packed-sequences-te-graphs, exit 2, no GPU work) / the plugin eager and graphed with it
# (expected: graphed == eager bit for bit; plugin eager printed == stock eager printed); (2) the four single-GPU farm
# cases gpt_4x2048_{docmask,sft}_{layer,attn}_megatron_lm, writing their golden values; (3) the functional test
# tests/functional/test_packed_graphs_gpu.py (capacity refusal, tiny-gpt at micro-batch 2). --sft needs transformers and
# datasets on the host: gpu.txt says whether they import (its probes and farm cases are skipped otherwise).
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
python3 -c "import transformers, datasets; print('sft imports: transformers', transformers.__version__, 'datasets', datasets.__version__)" >> $F/gpu.txt 2>&1
( MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_FARM_TIMEOUT_S=480 timeout 540 \
    python3 -m pytest tests/functional/test_farm.py -k "4x2048 and not cp2" -n 2 -rs -q -p no:cacheprovider > $F/farm.log 2>&1
  echo "farm rc=$?" >> $F/rc.txt
  mkdir -p $F/golden; for c in tests/functional/test_cases/gpt/gpt_4x2048_*; do
    [ -f $c/golden_values_dev_dgx_h200.json ] && cp $c/golden_values_dev_dgx_h200.json $F/golden/$(basename $c).json; done ) &
( MEGATRON_CG_FARM_OUT=$F/functional timeout 540 python3 -m pytest tests/functional/test_packed_graphs_gpu.py -rs -q \
    -p no:cacheprovider > $F/functional.log 2>&1; echo "functional rc=$?" >> $F/rc.txt ) &
flags() {  # the farm case's eager flags (its data built under $F/cases) without the plugin's, 10 steps
  python3 - "$1" <<'PY'
import os, sys
from pathlib import Path
from megatron_cg_plugin.testing import farm
out = Path(os.environ["F"]) / "cases"
case, _ = farm.prepare_case(f"tests/functional/test_cases/gpt/{sys.argv[1]}", out_dir=out,
                            megatron_lm_dir=os.environ["MEGATRON_LM_DIR"])
flags = case.run_flags(graphed=False, out_dir=out)
for flag in ("--cg-thd-max-seqs", "--cuda-graph-impl"):
    index = flags.index(flag)
    del flags[index:index + 2]
print(" ".join([*flags, "--train-iters", "10"]))
PY
}
export F
flags gpt_4x2048_docmask_layer_megatron_lm > $F/docmask_flags.txt 2>> $F/flags.err
python3 -c "import transformers, datasets" 2>/dev/null && flags gpt_4x2048_sft_layer_megatron_lm > $F/sft_flags.txt 2>> $F/flags.err
port=29740; pids=()
probe() {  # data (docmask|sft), name, runner (stock|plugin), extra flags
  local data=$1 name=$2 runner=$3; shift 3; port=$((port + 1))
  [ -s $F/${data}_flags.txt ] || { echo "$data $name skipped (no flags)" >> $F/rc.txt; return; }
  if [ $runner = stock ]; then cmd="python3 $MEGATRON_LM_DIR/pretrain_gpt.py"; else cmd="python3 -m megatron_cg_plugin.cli run $MEGATRON_LM_DIR/pretrain_gpt.py"; fi
  ( RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 420 \
      $cmd $(cat $F/${data}_flags.txt) "$@" > $F/${data}_$name.log 2>&1; echo "$data $name rc=$?" >> $F/rc.txt ) &
  pids+=($!)
}
for data in docmask sft; do
  probe $data stock_eager stock --cuda-graph-impl none
  probe $data stock_layer stock --cuda-graph-impl transformer_engine
  probe $data stock_attn stock --cuda-graph-impl transformer_engine --cuda-graph-modules attn
  probe $data plugin_layer_noflag plugin --cuda-graph-impl transformer_engine
  probe $data plugin_eager plugin --cuda-graph-impl none --cg-thd-max-seqs 32 --cg-metrics-out $F/${data}_plugin_eager.metrics.json
  probe $data plugin_layer plugin --cuda-graph-impl transformer_engine --cg-thd-max-seqs 32 \
    --cg-metrics-out $F/${data}_plugin_layer.metrics.json --cg-report-out $F/${data}_plugin_layer.report.json
  probe $data plugin_attn plugin --cuda-graph-impl transformer_engine --cuda-graph-modules attn --cg-thd-max-seqs 32 \
    --cg-metrics-out $F/${data}_plugin_attn.metrics.json --cg-report-out $F/${data}_plugin_attn.report.json
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"; pids=()  # one data set's 7 runs at a time beside the farm (GPU memory)
done
wait
python3 - > $F/compare.txt 2>&1 <<'PY'
import json, os, re
from pathlib import Path
F = Path(os.environ["F"])
line = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
for data in ("docmask", "sft"):
    printed = {name: dict(line.findall((F / f"{data}_{name}.log").read_text())) for name in ("stock_eager", "plugin_eager")
               if (F / f"{data}_{name}.log").exists()}
    if len(printed) == 2:
        print(data, "stock eager printed == plugin eager printed:", printed["stock_eager"] == printed["plugin_eager"], printed)
    metrics = {name: json.loads((F / f"{data}_{name}.metrics.json").read_text())["lm loss"]["values"]
               for name in ("plugin_eager", "plugin_layer", "plugin_attn") if (F / f"{data}_{name}.metrics.json").exists()}
    for name in ("plugin_layer", "plugin_attn"):
        if name in metrics and "plugin_eager" in metrics:
            print(data, name, "== plugin eager (exact):", metrics[name] == metrics["plugin_eager"])
PY
cat $F/rc.txt $F/compare.txt; tail -3 $F/farm.log $F/functional.log
for f in $F/*_stock_layer.log $F/*_stock_attn.log $F/*_noflag.log; do echo "== $f"; grep -h "AssertionError\|\[packed\|Error" $f | tail -2 | cut -c1-300; done
rm -rf $F/cases/data $F/farm/data $F/functional/packed_graphs/data
pack
