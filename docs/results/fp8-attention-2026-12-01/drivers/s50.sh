source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15, diagnosis: FusedAttnFunc's S-scale snapshot under slot capture through Megatron's layers (FP8 attention,
# delayed scaling, a user's script): created where, protected or not, held by what at the coverage check.
# Issue 14: the two user-script offload farm cases, not re-run since --cg-offload-window (run in parallel).
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 420 $T tests/functional/test_farm.py -k "gpt_12x1024_slot_offload_user_script or gpt_1b_slot_offload_user_script" > $F/farm_offload_user.log 2>&1; echo "farm offload user rc=$?" >> $F/rc.txt) &
(export NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 DIAG_OUT=$F/diag.jsonl PYTHONPATH=$PWD/.gpu-run/diag:$PYTHONPATH
 cd .gpu-run && timeout 240 python3 -m torch.distributed.run --nproc-per-node 1 -m megatron_cg_plugin.cli run user_pretrain_gpt_fp8_attention.py --num-layers 3 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 2 --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max --cg-slot-capture --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 --train-iters 5 --cuda-graph-impl transformer_engine > $F/run.log 2>&1; echo "diag run rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
grep -h "Error" $F/run.log | grep -v Warning | cut -c1-600 | tail -3
python3 - <<PY
import json, collections
rows = [json.loads(l) for l in open("$F/diag.jsonl")]
print(collections.Counter(r["kind"] for r in rows))
for r in rows:
    if r["kind"] in ("s_copy", "protected"): print(r)
for r in rows:
    if r["kind"] == "holders": print("\n".join(r["text"]))
PY
tail -n 3 $F/farm_offload_user.log; grep -h "FAILED\|Error" $F/farm_offload_user.log | cut -c1-400 | head -6
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_host_arena_bytes')})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
