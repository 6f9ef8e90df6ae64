source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: --cg-offload-window (in-graph copies run N groups beside the compute; between replays a ring of N+1
# buffers): the slot probe and the offload farm cases still exact, then the 1B bench over windows in one process.
# Issue 13: the tiny MoE, plugin / stock with cached batches.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 170 $T tests/functional/test_slot_memory.py -k "offload or snapshot or view" > $F/slot_memory.log 2>&1; echo "slot memory rc=$?" >> $F/rc.txt) &
(timeout 170 $T tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload or tiny_gpt_slot_fp8_offload" --deselect "tests/functional/test_farm.py::test_graphed_matches_eager_and_golden[tiny_moe_slot_offload_delayed]" > $F/farm.log 2>&1; echo "farm rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -n 4 $F/slot_memory.log $F/farm.log; grep -h "FAILED\|Error" $F/slot_memory.log $F/farm.log | cut -c1-300 | head -10
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
timeout 250 $B --bench-rounds 2 --bench-steps 6 --bench-out $F/bench-1b-windows --bench-arms slot,slot-offload-w1,slot-offload-w4,slot-offload-staged-w1,slot-offload-staged-w3 $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm > $F/bench-1b-windows.log 2>&1; echo "bench 1b rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b-windows/bench.md | head -40; grep -h "Error" $F/bench-1b-windows.log | tail -3
timeout 100 $B --bench-cached-batches 4 --bench-rounds 12 --bench-steps 4 --bench-skip-steps 1 --bench-arms stock,plugin --bench-out $F/bench-moe-cached --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine > $F/bench-moe-cached.log 2>&1; echo "bench moe rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-moe-cached/bench.md; grep "^| stock\|^| plugin" $F/bench-moe-cached/bench.md | head -2; grep -h "Error" $F/bench-moe-cached.log | tail -3
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
