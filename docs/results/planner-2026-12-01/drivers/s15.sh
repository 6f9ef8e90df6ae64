source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 17: the farm from its YAML folders and Megatron-LM's cases (--fit-gpus 1); issue 13: graph-pool allocation traces.
C=tests/functional/test_cases; M=.megatron-lm/test_cases
export MEGATRON_CG_FARM_TIMEOUT_S=300
farm() { name=$1; shift; timeout 470 python3 -m megatron_cg_plugin.cli farm --out $F/farm/$name "$@" > $F/farm_$name.log 2>&1; echo "farm $name rc=$?" >> $F/rc.txt; }
farm s1 $C/gpt/tiny_gpt_attn $C/gpt/tiny_gpt_layer $C/gpt/tiny_gpt_layer_capture_failure &
farm s2 $C/gpt/tiny_gpt_real_data $C/moe/tiny_moe_router &
farm s3 $C/moe/tiny_moe_droppad $C/moe/tiny_moe_real_data_spm &
farm s4 $C/gpt/gpt_12x1024_attn $C/gpt/gpt_12x1024_layer &
farm s5 $C/gpt/gpt_12x1024_attn_user_script $C/gpt/gpt_12x1024_layer_user_script &
farm m1 --fit-gpus 1 --steps 12 $M/moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph $M/moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph &
farm m2 --fit-gpus 1 --steps 12 $M/gpt/gpt3_mcore_te_tp1_pp4_swiglu $M/gpt/gpt3_mcore_te_tp2_pp2_mla &
(
  mkdir -p $F/traces
  G="--train-iters 5 --cuda-graph-impl transformer_engine"
  trace() { name=$1; shift; timeout 120 python3 .gpu-run/memtrace.py $F/traces/$name.json.gz "$@" --cg-report-out $F/traces/$name.report.json $G > $F/traces/$name.log 2>&1; echo "trace $name rc=$?" >> $F/rc.txt; }
  trace dense_tiny_layer --cg-preset tiny-gpt
  trace dense_tiny_attn --cg-preset tiny-gpt --cuda-graph-modules attn
  trace dense_tiny_dropout --cg-preset tiny-gpt --hidden-dropout 0.1 --attention-dropout 0.1
  trace moe_droppad --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity
  trace moe_router --cg-preset tiny-moe --cuda-graph-modules attn moe_router moe_preprocess
  trace llama --cg-preset tiny-gpt --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512
  trace dense_1024 --cg-preset tiny-gpt --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000
  trace dense_2048 --cg-preset tiny-gpt --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768
) &
wait
cat $F/rc.txt
for f in $F/farm_*.log; do echo "== $f"; grep -E "^== |PASS|FAIL|Error|error:" $f | head -20; done
pack
