source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s90 (issue 31), alone on the GPU: (1) what the plugin arm runs in Python that stock does not, on the Llama-like
# model (s89: +0.48 ms a step on its undisturbed cycles, 0.14 ms of it the contract check): 30 cycles with
# --bench-profile-dir, whose python_calls.json now counts every Python function per step; (2) the recording hooks'
# cost as committed after review (recording_cost) on the 4-layer GPT; (3) the realistic MoE, plugin / stock
# alone, drop-and-pad through the launcher and dropless through Megatron-LM's pretrain_gpt.py. The collector's
# time is logged per process (gc_probe/sitecustomize.py) in (1) and (2), to tell whether the host's slow mode is it.
source "$(dirname "$0")/../../session-2026-12-03/drivers/moe_data.sh"
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29950 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; }
GCP="$(cd "$(dirname "$0")" && pwd)/gc_probe"
PYTHONPATH=$GCP:$PYTHONPATH CG_GC_LOG=$F/llama.gc bench llama 80 --bench-arms stock,plugin --bench-cycles 30 \
  --bench-profile-dir $F/llama_profile --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
python3 -m megatron_cg_plugin.bench_output --host-diff $F/llama_profile plugin stock > $F/llama_host_diff.txt 2>&1
rm -f $F/llama_profile/*.device_timeline.json.gz
PYTHONPATH=$GCP:$PYTHONPATH CG_GC_LOG=$F/gpt4.gc bench gpt4 80 --bench-arms plugin-recording,plugin --bench-cycles 40 \
  --cg-preset tiny-gpt --num-layers 4 $G
bench droppad 160 --bench-arms plugin,stock --bench-cycles 110 $(cat $F/moe_flags.txt) $DATA \
  --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity $G --cuda-graph-modules attn moe
bench dropless 170 --bench-arms stock,plugin --bench-cycles 50 $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/moe_flags.txt) \
  $DATA $G --cuda-graph-modules attn moe_router moe_preprocess
rm -rf $F/data; pack; cat $F/rc.txt; head -50 $F/llama_host_diff.txt | cut -c1-200
for n in gpt4 droppad dropless; do echo "== $n"; sed -n '/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
cat $F/*.gc.*.json | head -60
