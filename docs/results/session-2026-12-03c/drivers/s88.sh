source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s88 (issue 31), alone on the GPU: the memory read's host cost per logged step, old and new (probe_cost.py),
# then s86's 4-layer GPT recording bench again on the one-read probe, with the hooks' own cost in bench.md.
python3 docs/results/session-2026-12-03c/drivers/probe_cost.py > $F/probe_cost.txt 2>&1; echo "probe rc=$?" >> $F/rc.txt
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
MASTER_PORT=29941 timeout 170 python3 -m megatron_cg_plugin.cli bench --bench-interleave steps --bench-skip-steps 4 \
  --bench-arms plugin-recording,plugin --bench-no-plot --bench-cycles 300 --bench-out $F/gpt4 \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/gpt4.log 2>&1; echo "gpt4 rc=$?" >> $F/rc.txt
pack; cat $F/rc.txt $F/probe_cost.txt | cut -c1-300; sed -n '/^| arm/,$p' $F/gpt4/bench.md; grep -h "Error\|error:" $F/gpt4.log | tail -3
