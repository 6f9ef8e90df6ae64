source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: held-out check of the host-arena prediction (docs/results/offload-2026-12-01/heldout), eager == graphed.
export NVTE_CPU_OFFLOAD_V1=1
for h in h1 h2; do
  (timeout 300 python3 -m megatron_cg_plugin.cli farm --out $F/$h .gpu-run/heldout/$h > $F/$h.log 2>&1; echo "$h rc=$?" >> $F/rc.txt) &
done
wait
cat $F/rc.txt
for h in h1 h2; do tail -6 $F/$h.log; grep -h "pinned host arenas\|GPU arenas" $F/$h/*graphed*.log* $F/$h/*/*.log 2>/dev/null | tail -2; python3 -c "
import json,glob
for f in glob.glob('$F/$h/*graphed.report.json'):
    r=json.load(open(f)); s=r['scopes'][0]; print('$h', s['scope'], 'host', s.get('host_arena_bytes'), 'pred', r.get('predicted_host_arena_bytes'), 'arena', s.get('arena_bytes'), 'pool', s['pool_bytes'], 'offl', s.get('offloaded_bytes'))
"; done
rm -rf $F/h1/data $F/h2/data $F/*/*.logs
pack
