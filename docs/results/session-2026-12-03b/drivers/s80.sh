source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s80 (issue 34): s79's plugin-layout runs asked TE's unfused attention for 16 GiB (32 x 16 x 4096 x 4096 scores):
# which backend TE picks for Megatron's packed layout and for the plugin's fixed one, deterministic and not, and
# whether the two layouts give the same bits.
NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 150 python3 docs/results/session-2026-12-03b/drivers/attn_probe.py > $F/probe_det.log 2>&1
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 150 python3 docs/results/session-2026-12-03b/drivers/attn_probe.py > $F/probe_nondet.log 2>&1
python3 -c "import torch; print('cudnn', torch.backends.cudnn.version())" >> $F/gpu.txt
for f in $F/probe_*.log; do echo "#### $f"; grep -v "^$" $f | grep -i "==\|documents\|selected\|disabling\|available\|env\|Error" | sort | uniq -c | sort -rn | head -40 | cut -c1-300; done
pack
