source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15, diagnosis only: which save the capture of an FP8-attention layer (delayed scaling, through Megatron's
# layers, a user's script) places beyond what its warmup measured (s47: 4 bytes). Logs every arena placement.
export NVTE_CPU_OFFLOAD_V1=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 DIAG_OUT=$F/diag.jsonl
export PYTHONPATH=$PWD/.gpu-run/diag:$PYTHONPATH
(cd .gpu-run && timeout 240 python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_cg_plugin.cli run user_pretrain_gpt_fp8_attention.py --num-layers 3 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 2 --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max --cg-slot-capture --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 --train-iters 5 --cuda-graph-impl transformer_engine > $F/run.log 2>&1; echo "run rc=$?")
grep -h "Error\|error:" $F/run.log | grep -v Warning | cut -c1-300 | tail -5
python3 - <<'PY'
import json, collections, os
rows = [json.loads(l) for l in open(os.environ["DIAG_OUT"])]
frames = collections.defaultdict(list)
for r in rows: frames[r["frame"]].append(r)
for f in sorted(frames)[:4]:
    rs = frames[f]; print("frame", f, rs[0]["kind"], len(rs), "storages", sum(r["nbytes"] for r in rs), "bytes")
def key(r): return (r["nbytes"], r["dtype"], tuple(r["shape"]), r["ctx"], r["node"])
a, b = [key(r) for r in frames[1]], [key(r) for r in frames[2]]
ca, cb = collections.Counter(a), collections.Counter(b)
print("in capture, not warmup:", list((cb - ca).items()))
print("in warmup, not capture:", list((ca - cb).items()))
for r in frames[2][-8:]: print("capture tail", r)
for r in frames[1][-8:]: print("warmup tail", r)
PY
pack
