source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: where in-graph offload's cost goes (device timelines of the 1B's slot, in-graph and between-replays arms),
# and the same arms plus Megatron's own offload with TE graphs on GPT-3 6.7B's shape (32 x 4096), whose layers have
# about twice the compute per offloaded byte of the 1B's and whose attention groups hold a larger share.
export NVTE_CPU_OFFLOAD_V1=1
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
B1="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
G67="--cg-preset tiny-gpt --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16"
GR="--cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
timeout 240 $B --bench-rounds 2 --bench-steps 6 --bench-out $F/bench-1b --bench-profile-dir $F/bench-1b/profile --bench-arms slot,slot-offload-w1,slot-offload-staged-w1,slot-offload-w1-f50,slot-offload-staged-w1-f50 $B1 $GR $OFF > $F/bench-1b.log 2>&1; echo "bench 1b rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b/bench.md | head -30; grep -h "Error" $F/bench-1b.log | tail -3
nvidia-smi --query-gpu=memory.used --format=csv
timeout 310 $B --bench-rounds 2 --bench-steps 5 --bench-out $F/bench-67b --bench-profile-dir $F/bench-67b/profile --bench-arms slot,slot-offload-w1,slot-offload-staged-w1,stock $G67 $GR $OFF > $F/bench-67b.log 2>&1; echo "bench 6.7b rc=$?"
sed -n '/^| arm/,$p' $F/bench-67b/bench.md | head -30; grep -h "Error\|error" $F/bench-67b.log | tail -5; tail -3 $F/bench-67b.log
rm -f $F/bench-*/profile/*.host_ops.txt
pack; ls -la $OUT
