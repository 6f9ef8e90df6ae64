source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Ran as s84 (../../session-2026-12-03c): issues 34 and 32, each alone on the GPU, one after the other:
# the launcher's packed path (test_the_launcher_trains_packed_graphs_like_its_eager_run, ~2 min), then the 6.7B farm
# case (its eager run holds 118 GiB: nothing beside it; s79).
( MEGATRON_CG_FARM_OUT=$F/functional timeout 240 python3 -m pytest tests/functional/test_packed_graphs_gpu.py -rs -q \
    -p no:cacheprovider -k launcher > $F/launcher_packed.log 2>&1; echo "launcher packed rc=$?" >> $F/rc.txt )
MEGATRON_CG_FARM_OUT=$F/farm6p7b MEGATRON_CG_FARM_TIMEOUT_S=300 timeout 330 python3 -m pytest -q -rs \
  -p no:cacheprovider tests/functional/test_farm.py -k 6p7b > $F/farm_6p7b.log 2>&1; echo "6p7b rc=$?" >> $F/rc.txt
cat $F/rc.txt; tail -n 3 $F/launcher_packed.log $F/farm_6p7b.log | cut -c1-300
rm -rf $F/farm6p7b/data $F/functional/packed_graphs/data; pack
