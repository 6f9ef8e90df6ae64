source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 30, diagnosis. (1) FP8 current scaling under --cg-slot-capture at the issue's shape through Megatron-LM's own
# pretrain_gpt.py (megatron-cg run): eager vs graphed, and bisect runs (one microbatch, mbs 1, delayed scaling, a
# smaller hidden size, attn scope); the graphed base run also sets each of its first replays beside the same layer
# run eagerly (drivers/fp8diag). (2) Allocator traces of TE's own pool on the issue's realistic MoE, drop-and-pad
# attn moe and dropless attn moe_router moe_preprocess, and of slot capture's attn moe.
D=$(dirname "$0"); R="python3 -m megatron_cg_plugin.cli run $MEGATRON_LM_DIR/pretrain_gpt.py"
COMMON="--position-embedding-type rope --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-num-zeros-in-grad --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --deterministic-mode --seq-length 2048 --max-position-embeddings 2048"
BIG="--num-layers 5 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16"
T8="--fp8-format hybrid --fp8-recipe tensorwise"; D8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
mkdir -p $F/fp8
one() { name=$1; shift; timeout 240 $R $COMMON "$@" --train-iters 8 --cg-metrics-out $F/fp8/$name.metrics.json --cg-report-out $F/fp8/$name.report.json > $F/fp8/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; }
pair() { name=$1; shift; one $name.eager "$@" --cuda-graph-impl none; one $name.graphed "$@" --cuda-graph-impl transformer_engine --cg-slot-capture; }
( pair base $BIG --micro-batch-size 2 --global-batch-size 8 $T8
  pair mb1 $BIG --micro-batch-size 2 --global-batch-size 2 $T8 ) &
( DIAG_OUT=$F/fp8/diag.jsonl PYTHONPATH=$D/fp8diag:$PYTHONPATH one base.graphed_diag $BIG --micro-batch-size 2 --global-batch-size 8 $T8 --cuda-graph-impl transformer_engine --cg-slot-capture
  pair mbs1 $BIG --micro-batch-size 1 --global-batch-size 4 $T8
  one base.attn $BIG --micro-batch-size 2 --global-batch-size 8 $T8 --cuda-graph-impl transformer_engine --cg-slot-capture --cuda-graph-modules attn ) &
( pair delayed $BIG --micro-batch-size 2 --global-batch-size 8 $D8
  pair h1024 --num-layers 5 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --micro-batch-size 2 --global-batch-size 8 $T8 ) &
# MoE traces (launcher; TE's pool and slot capture's), one at a time beside the FP8 lanes.
MOE="--cg-preset tiny-gpt --num-layers 8 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --group-query-attention --num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32000 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1408 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --swiglu --disable-bias-linear --train-iters 5 --cuda-graph-impl transformer_engine --deterministic-mode"
DP="--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"
TP=$D/trace:$PYTHONPATH; mkdir -p $F/traces
trace() { name=$1; shift; MEMTRACE_DIR=$F/traces/$name PYTHONPATH=$TP timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt "$@" --cg-report-out $F/traces/$name.report.json > $F/traces/$name.log 2>&1; echo "trace $name rc=$?" >> $F/rc.txt; }
( trace moe_droppad $MOE $DP --cuda-graph-modules attn moe
  trace moe_dropless $MOE --cuda-graph-modules attn moe_router moe_preprocess
  trace moe_droppad_slot $MOE $DP --cuda-graph-modules attn moe --cg-slot-capture ) &
wait
cat $F/rc.txt
python3 - $F <<'PY'
import json, sys, glob, os
F = sys.argv[1]
def losses(p):
    try: return json.load(open(p))["lm loss"]["values"]
    except Exception as e: return {"error": str(e)}
for name in ("base", "mb1", "mbs1", "delayed", "h1024"):
    e, g = losses(f"{F}/fp8/{name}.eager.metrics.json"), losses(f"{F}/fp8/{name}.graphed.metrics.json")
    diff = {k: (e[k], g.get(k)) for k in e if e[k] != g.get(k)} if isinstance(e, dict) and "error" not in e else e
    print(name, "equal" if not diff else f"DIFFERS {diff}")
for name in ("base.graphed_diag", "base.attn"):
    g, e = losses(f"{F}/fp8/{name}.metrics.json"), losses(f"{F}/fp8/base.eager.metrics.json")
    print(name, {k: (e.get(k), g[k]) for k in g if e.get(k) != g[k]} if "error" not in g else g)
for p in sorted(glob.glob(f"{F}/fp8/*graphed*.report.json") + glob.glob(f"{F}/traces/*.report.json")):
    r = json.load(open(p)); s = r["scopes"][0] if r.get("scopes") else {}
    print(os.path.basename(p), {k: s.get(k) for k in ("replays", "rejected", "pool_bytes", "arena_bytes", "teardown_allocated_delta_bytes", "teardown_pool_bytes_left", "failure")},
          "pred", r.get("predicted_pool_bytes"), r.get("predicted_arena_bytes"), "step ms", r.get("eager_step_ms"), r.get("graphed_step_ms"))
PY
head -c 3000 $F/fp8/diag.jsonl 2>/dev/null
for f in $F/fp8/*.log $F/traces/*.log; do grep -l "Traceback\|Error" $f >/dev/null && { echo "== $f"; grep -h "Error" $f | tail -3 | cut -c1-300; }; done
pack
