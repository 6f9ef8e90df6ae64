source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: what is alive at the peak of a 1B step, slot-offload against Megatron's offload with TE graphs (s40
# retried: the wrapper keeps train_step's signature). Issue 13: plugin / stock on the two host-bound dense models,
# more pairs (24 rounds of 4 steps), the loader's batches cached.
export NVTE_CPU_OFFLOAD_V1=1
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp --train-iters 7 --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
(timeout 240 python3 .gpu-run/peak_trace.py $F/peak_slot_offload.json 6 $M --cg-slot-capture > $F/peak_slot.log 2>&1; echo "peak slot rc=$?" >> $F/rc.txt) &
(timeout 240 python3 .gpu-run/peak_trace.py $F/peak_stock.json 6 $M > $F/peak_stock.log 2>&1; echo "peak stock rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
for f in $F/peak_*.json; do echo "== $f"; python3 -c "
import json; d=json.load(open('$f')); print({k: round(v) for k, v in d.items() if not isinstance(v, list)})
for site, mib in d['alive_at_peak_by_site_mib'][:14]: print(f'  {mib:9.1f} MiB  {site[:260]}')"; done
grep -h "Error" $F/peak_*.log | tail -4
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-cached-batches 4 --bench-rounds 24 --bench-steps 4 --bench-skip-steps 1 --bench-arms stock,plugin"
timeout 150 $B --bench-out $F/bench-gpt4-cached --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/bench-gpt4-cached.log 2>&1; echo "bench gpt4 rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-gpt4-cached/bench.md; grep "^| stock\|^| plugin" $F/bench-gpt4-cached/bench.md | head -2
timeout 150 $B --bench-out $F/bench-llama-cached --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine > $F/bench-llama-cached.log 2>&1; echo "bench llama rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-llama-cached/bench.md; grep "^| stock\|^| plugin" $F/bench-llama-cached/bench.md | head -2
pack
