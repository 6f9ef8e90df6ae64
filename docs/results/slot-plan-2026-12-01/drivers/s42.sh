source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: the slot-offload 1B step starts with ~2 GB more allocated than Megatron's offload with TE graphs
# (s41), about the size of the bf16 parameters: what is alive at the start of a step, by allocation site.
export NVTE_CPU_OFFLOAD_V1=1
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp --train-iters 7 --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
(timeout 280 python3 .gpu-run/static_trace.py $F/static_slot.json 6 $M --cg-slot-capture > $F/static_slot.log 2>&1; echo "static slot rc=$?" >> $F/rc.txt) &
(timeout 280 python3 .gpu-run/static_trace.py $F/static_stock.json 6 $M > $F/static_stock.log 2>&1; echo "static stock rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
for f in $F/static_*.json; do echo "== $f"; python3 -c "
import json; d=json.load(open('$f')); print(round(d['allocated_mib']))
for site, mib in d['by_site_mib'][:22]: print(f'  {mib:9.1f} MiB  {site[:300]}')"; done
grep -h "Error" $F/static_*.log | tail -4
pack
