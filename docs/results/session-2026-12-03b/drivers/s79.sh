source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s79 (issues 34 and 32; correctness, one call on 1x H200 with the packed gate dropped in the tree): the 6.7B farm
# case (issue 32's last single-GPU case, ~78 GB) beside s74a's packed probes, farm cases and functional test. The SFT
# cases need HuggingFace datasets, which the host lacks: its wheel and the two the host also lacks (dill,
# multiprocess; pyarrow, pandas, fsspec and huggingface-hub are there) travel in .sftwheels/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .sftwheels/*.whl >> $F/gpu.txt 2>&1
( MEGATRON_CG_FARM_OUT=$F/farm6p7b MEGATRON_CG_FARM_TIMEOUT_S=520 timeout 560 python3 -m pytest -q -rs \
    -p no:cacheprovider tests/functional/test_farm.py -k 6p7b > $F/farm_6p7b.log 2>&1; echo "6p7b rc=$?" >> $F/rc.txt
  rm -rf $F/farm6p7b/data ) &
sleep 20  # the 6.7B run's model on the GPU first
OUT=$OUT bash docs/results/packed-2026-12-03/drivers/s74a.sh
wait
tail -5 $F/farm_6p7b.log | cut -c1-400; pack
