source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 30, last call of the session: (1) the support matrix as designed today (cells.json: the FP8 MoE slot cells
# are refused by check now), 7 cells side by side; (2) why s66's gpt_layer_bf16_slotoffload_1 died with an illegal
# memory access in its first (eager) step: the graphed run again, without dropout, and eager with Megatron's offload
# with and without dropout; (3) the FP8 current-scaling farm case, golden values written by this run.
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
export MEGATRON_CG_FARM_TIMEOUT_S=330
( timeout 540 python3 -m megatron_cg_plugin.cli matrix run $M/cells.json --out $F/matrix --jobs 7 > $F/matrix.log 2>&1; echo "matrix rc=$?" >> $F/rc.txt ) &
( C=gpt_5x2048_slot_fp8_tensorwise_megatron_lm
  MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?" >> $F/rc.txt
  cp tests/functional/test_cases/gpt/$C/golden_values_dev_dgx_h200.json $F/golden_$C.json 2>/dev/null ) &
mkdir -p $F/bisect
python3 - $F/bisect <<'PY' > $F/bisect/commands.txt
import dataclasses, shlex, sys
from pathlib import Path
from megatron_cg_plugin.testing import matrix
out = Path(sys.argv[1])
cell = matrix.Cell({"model": "gpt", "scope": "layer", "precision": "bf16", "capture": "slot-offload", "mbs": "1"})
case = dataclasses.replace(matrix.farm_case(cell, megatron_lm_dir="/root/.megatron-lm", steps=6), eager_offload=True)
import os; case = dataclasses.replace(case, megatron_lm_dir=os.environ["MEGATRON_LM_DIR"])
nodrop = dataclasses.replace(case, flags=case.flags + ("--hidden-dropout", "0.0", "--attention-dropout", "0.0"))
for name, c, graphed in (("graphed", case, True), ("graphed_nodropout", nodrop, True),
                         ("eager_offload", case, False), ("eager_offload_nodropout", nodrop, False)):
    argv = c.argv(graphed=graphed, out_dir=out / name)
    print(name, shlex.join(["python3", *argv]))
PY
while read name cmd; do ( mkdir -p $F/bisect/$name; NVTE_CPU_OFFLOAD_V1=1 timeout 300 bash -c "$cmd" > $F/bisect/$name.log 2>&1; echo "bisect $name rc=$?" >> $F/rc.txt ) & done < $F/bisect/commands.txt
wait
cat $F/rc.txt; grep -h ": exact\|: differs\|: failed\|: refused" $F/matrix.log
for f in $F/bisect/*.log; do echo "== $f"; grep -h "illegal\|Error\|iteration *[0-9]*/" $f | tail -3 | cut -c1-300; done
tail -n 2 $F/farm_*.log | cut -c1-300
python3 -m megatron_cg_plugin.cli matrix render $F/matrix/matrix.json > $F/support-matrix.md; tail -n 30 $F/support-matrix.md
mkdir -p $F/logtails
for d in $F/matrix/*.logs; do n=$(basename $d .logs); for s in stdout stderr; do f=$(ls $d/*/attempt_0/0/$s.log 2>/dev/null | head -1); [ -n "$f" ] && tail -c 4000 $f > $F/logtails/$n.$s.txt; done; done
rm -rf $F/matrix/*.logs $F/matrix/data $F/farm/*.logs $F/farm/data $F/bisect/*/data
pack
