source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15, diagnosis: FusedAttnFunc's S-scale snapshot under slot capture through Megatron's layers (FP8 attention,
# delayed scaling, a user's script): created where, protected or not, held by what at the coverage check.
# (s50 missed user_pretrain_gpt.py in .gpu-run.) Issue 13: the Llama-like model, stock vs plugin, 40 rounds of 4
# steps on cached batches (20 pairs), after the diagnosis, alone on the GPU.
export NVTE_CPU_OFFLOAD_V1=1
(export NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 DIAG_OUT=$F/diag.jsonl PYTHONPATH=$PWD/.gpu-run/diag:$PYTHONPATH
 cd .gpu-run && timeout 240 python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_cg_plugin.cli run user_pretrain_gpt_fp8_attention.py --num-layers 3 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 2 --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max --cg-slot-capture --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 --train-iters 5 --cuda-graph-impl transformer_engine > $F/run.log 2>&1; echo "diag run rc=$?" >> $F/rc.txt)
cat $F/rc.txt
grep -h "Error" $F/run.log | grep -v Warning | cut -c1-600 | tail -3
python3 - <<PY
import json, collections
rows = [json.loads(l) for l in open("$F/diag.jsonl")]
print(collections.Counter(r["kind"] for r in rows))
for r in rows:
    if r["kind"] == "holders": print("\n".join(r["text"]))
caps = [r for r in rows if r["kind"] == "s_copy" and r["capturing"]]
print("S copies made under capture:", len(caps)); [print(r) for r in caps[:8]]
prot = [r for r in rows if r["kind"] == "protected"]
print("protected rows:", len(prot)); [print(r) for r in prot[:30]]
PY
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
L="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine"
timeout 330 $B --bench-cached-batches 4 --bench-rounds 40 --bench-steps 4 --bench-skip-steps 1 --bench-arms stock,plugin --bench-out $F/bench-llama-long $L > $F/bench-llama-long.log 2>&1; echo "bench llama rc=$?"
sed -n '/^| ratio/,/^$/p' $F/bench-llama-long/bench.md; grep "^| stock\|^| plugin" $F/bench-llama-long/bench.md | head -2; grep -h "Error" $F/bench-llama-long.log | tail -3
pack
