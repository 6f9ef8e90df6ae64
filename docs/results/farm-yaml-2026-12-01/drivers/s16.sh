source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: held-out graph-pool predictions (written before this run), the MoE arm's host profile; issue 17: Megatron's cases again.
M=.megatron-lm/test_cases; G="--cuda-graph-impl transformer_engine"
export MEGATRON_CG_FARM_TIMEOUT_S=270
mkdir -p $F/heldout
run() { name=$1; shift; timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt "$@" $G --train-iters 5 --cg-report-out $F/heldout/$name.report.json > $F/heldout/$name.log 2>&1; echo "heldout $name rc=$?" >> $F/rc.txt; }
farm() { name=$1; shift; timeout 560 python3 -m megatron_cg_plugin.cli farm --out $F/farm/$name "$@" > $F/farm_$name.log 2>&1; echo "farm $name rc=$?" >> $F/rc.txt; }
farm m1b --fit-gpus 1 --steps 12 $M/moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph &
farm m2 --fit-gpus 1 --steps 12 $M/gpt/gpt3_mcore_te_tp1_pp4_swiglu $M/gpt/gpt3_mcore_te_tp2_pp2_mla &
(
run H1_gpt6_768_learned --cg-preset tiny-gpt --num-layers 6 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 8 --position-embedding-type learned_absolute
run H2_gqa_swiglu_attn --cg-preset tiny-gpt --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 --group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm --disable-bias-linear --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 4 --cuda-graph-modules attn
run H3_moe8_droppad --cg-preset tiny-moe --num-experts 8 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --cuda-graph-modules attn moe
run H4_seq4096_1536 --cg-preset tiny-gpt --num-layers 4 --hidden-size 1536 --ffn-hidden-size 6144 --num-attention-heads 12 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 2
) &
(
run H5_mlp_dropout --cg-preset tiny-gpt --num-layers 8 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16 --hidden-dropout 0.1 --cuda-graph-modules mlp
run H6_moe8_router --cg-preset tiny-moe --num-experts 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 --cuda-graph-modules attn moe_router moe_preprocess
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 run H7_12x1024_nondet --cg-preset tiny-gpt --num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 run H8_gpt4_nondet --cg-preset tiny-gpt --num-layers 4
) &
sleep 200
timeout 300 python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-rounds 4 --bench-steps 8 --bench-out $F/moe_bench --bench-profile-dir $F/moe_bench/profile \
  --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity $G > $F/moe_bench.log 2>&1; echo "bench moe rc=$?" >> $F/rc.txt
wait
cat $F/rc.txt
grep -h "graph pool: predicted" $F/heldout/*.log
for f in $F/farm_*.log; do echo "== $f"; grep -E "^== |PASS|FAIL|Error|error:" $f | cut -c1-400 | head -12; done
grep -A6 "^| arm" $F/moe_bench.log | head -8
pack
