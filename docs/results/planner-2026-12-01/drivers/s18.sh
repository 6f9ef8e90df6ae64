source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: the routers' measured drops with padded capacity (after the tap counted padded slots as kept).
C=tests/functional/test_cases
export MEGATRON_CG_FARM_TIMEOUT_S=200
farm() { name=$1; shift; timeout 300 python3 -m megatron_cg_plugin.cli farm --out $F/farm/$name "$@" > $F/farm_$name.log 2>&1; echo "farm $name rc=$?" >> $F/rc.txt; }
farm a $C/moe/tiny_moe_droppad &
farm b $C/moe/tiny_moe_real_data_spm &
wait
cat $F/rc.txt
for f in $F/farm_*.log; do echo "== $f"; grep -E "^== |PASS|FAIL|^\|" $f | cut -c1-300; done
pack
