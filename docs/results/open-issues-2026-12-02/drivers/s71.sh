source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s71: s70's fitted Megatron MoE offloading case (attention graphed) trained differently from step 5 (the first loss
# after a graphed step's gradients). Bisect, side by side: the same case without one factor each (offload,
# selective recompute, MTP, MLA) through the farm, and Megatron's own TE graphs (no plugin) on the case as fitted.
D=$(cd "$(dirname "$0")" && pwd); M=$D/..; V=$F/variants; mkdir -p $V
python3 - $M/cases/gpt3_moe_fine_grained_offloading_attn $V > $F/variants.txt <<'PY'
import sys, yaml, pathlib, shlex
from megatron_cg_plugin.testing import farm
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
base = yaml.safe_load((src / "model_config.yaml").read_text())
drop = {
    "nooffload": ["--fine-grained-activation-offloading", "--offload-modules"],
    "norecompute": ["--recompute-granularity", "--recompute-modules"],
    "nomtp": ["--mtp-num-layers", "--mtp-loss-scaling-factor"],
    "nomla": ["--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
              "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim"],
}
for name, flags in drop.items():
    data = yaml.safe_load((src / "model_config.yaml").read_text())
    for flag in flags:
        data["MODEL_ARGS"].pop(flag)
    folder = out / f"ep4_{name}"; folder.mkdir(parents=True)
    (folder / "model_config.yaml").write_text(yaml.safe_dump(data))
    print(folder)
case, _ = farm.prepare_case(src, out_dir=out / "stock", gpus=1, steps=6)
for graphed in (False, True):
    flags = [f for f in case.run_flags(graphed=graphed, out_dir=out / "stock") if not f.startswith("--cg-")]
    (out / f"stock_{'graphed' if graphed else 'eager'}.flags").write_text(shlex.join(flags + ["--train-iters", "6"]))
PY
for folder in $(cat $F/variants.txt); do
  n=$(basename $folder)
  ( timeout 500 python3 -m megatron_cg_plugin.cli farm $folder --fit-gpus 1 --out $F/$n --steps 6 > $F/$n.log 2>&1; echo "$n rc=$?" >> $F/rc.txt ) &
  sleep 4
done
port=29810
for mode in eager graphed; do port=$((port + 1))
  ( export $(python3 -c "import yaml;d=yaml.safe_load(open('$M/cases/gpt3_moe_fine_grained_offloading_attn/model_config.yaml'))['ENV_VARS'];print(' '.join(f'{k}={v}' for k,v in d.items() if k!='PYTHONWARNINGS'))") NCCL_GRAPH_REGISTER=0
    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 500 \
    bash -c "python3 $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $V/stock_$mode.flags)" > $F/stock_$mode.log 2>&1; echo "stock $mode rc=$?" >> $F/rc.txt ) &
done
wait
cat $F/rc.txt
for f in $F/ep4_*.log; do echo "== $f"; grep -h "differs\|PASS\|FAIL\|REFUSED\|^| ep4" $f | cut -c1-400; done
for mode in eager graphed; do echo "== stock $mode"; grep -o "iteration *[0-9]*/.*lm loss: [0-9.E+-]*" $F/stock_$mode.log | sed 's/|.*lm loss/ lm loss/'; grep -h "Error" $F/stock_$mode.log | tail -3; done
rm -rf $F/*/*.logs $F/variants/stock
pack
