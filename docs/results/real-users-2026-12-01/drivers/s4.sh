source "$(dirname "$0")/common.sh"
timeout 200 python3 -m pytest tests/functional/test_thd_partition.py -v -rs -p no:cacheprovider 2>&1 | tail -5
