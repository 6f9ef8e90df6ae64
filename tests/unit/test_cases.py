"""Farm cases in Megatron's model_config.yaml format: loading, validation, rendering."""

import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin.farm.cases import CaseError, FarmSettings, load_case, render_flags

MEGATRON_LM = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")


def case(tmp_path: Path, text: str, name: str = "gpt3_tiny") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_config.yaml").write_text(textwrap.dedent(text))
    return folder


TINY = """
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 0
  CUBLAS_WORKSPACE_CONFIG: :4096:8
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 256
  --lr: 1.0e-4
  --bf16: true
  --use-cpu-initialization: false
  --cuda-graph-modules: "[attn mlp moe_router moe_preprocess]"
  --moe-layer-freq: ([0]*1+[1]*1)
  --data-path: ${DATA_PATH}/text/my-gpt3_00_text_document
  --tensorboard-dir: ${TENSORBOARD_PATH}
  --cg-contract-check: shapes
METRICS:
  - "lm loss"
  - "num-zeros"
TEST_TYPE: regular
CG_FARM:
  nproc: 2
  compare: eager-only
"""


def test_a_megatron_case_loads_and_renders_as_megatron_does(tmp_path):
    loaded = load_case(case(tmp_path, TINY))
    assert loaded.name == "gpt3_tiny"
    assert loaded.env == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    assert loaded.metrics == ("lm loss", "num-zeros")
    assert loaded.farm == FarmSettings(nproc=2, compare="eager-only")
    flags = loaded.flags({"DATA_PATH": "/data", "TENSORBOARD_PATH": "/tmp/tb"})
    assert flags == [
        "--num-layers",
        "2",
        "--hidden-size",
        "256",
        "--lr",
        "0.0001",
        "--bf16",
        "--cuda-graph-modules",
        "attn",
        "mlp",
        "moe_router",
        "moe_preprocess",
        "--moe-layer-freq",
        "([0]*1+[1]*1)",
        "--data-path",
        "/data/text/my-gpt3_00_text_document",
        "--tensorboard-dir",
        "/tmp/tb",
        "--cg-contract-check",
        "shapes",
    ]


def test_unresolved_placeholders_are_named(tmp_path):
    loaded = load_case(case(tmp_path, TINY))
    with pytest.raises(CaseError, match=r"\$\{DATA_PATH\}, \$\{TENSORBOARD_PATH\} are not resolved"):
        loaded.flags({})


@pytest.mark.parametrize(
    "text, message",
    [
        ("MODEL_ARGS:\n  --num-layers: 2\nSURPRISE: 1\n", "unknown key"),
        ("MODEL_ARGS:\n  --num-layers: 2\nBEFORE_SCRIPT: |\n  rm -rf /\n", "BEFORE_SCRIPT is refused"),
        ("MODEL_ARGS:\n  --num-layers: 2\nMODE: inference\n", "MODE 'inference'"),
        ("MODEL_ARGS:\n  --num-layers: 2\nTEST_TYPE: frozen-start\n", "needs a checkpoint"),
        ("ENV_VARS: {}\n", "MODEL_ARGS must map"),
        ("MODEL_ARGS:\n  num-layers: 2\n", "spelled as Megatron spells them"),
        ("MODEL_ARGS:\n  --num-layers: 2\nMETRICS: lm loss\n", "METRICS must be a list"),
        ("MODEL_ARGS:\n  --num-layers: 2\nCG_FARM:\n  gpus: 2\n", "CG_FARM has unknown key"),
        ("MODEL_ARGS:\n  --num-layers: 2\nCG_FARM:\n  nproc: 0\n", "nproc 0"),
        ("MODEL_ARGS:\n  --num-layers: 2\nCG_FARM:\n  compare: exact\n", "compare 'exact'"),
        ("MODEL_ARGS: [1, 2\n", "not valid YAML"),
        ("- just a list\n", "must be a mapping"),
    ],
)
def test_bad_case_files_are_refused_naming_the_fix(tmp_path, text, message):
    with pytest.raises(CaseError, match=message) as info:
        load_case(case(tmp_path, text))
    assert "model_config.yaml" in str(info.value)


def test_a_folder_without_a_case_file(tmp_path):
    with pytest.raises(CaseError, match=r"holds no model_config\.yaml"):
        load_case(tmp_path)


def test_yaml_tags_do_not_execute(tmp_path):
    with pytest.raises(CaseError, match="not valid YAML"):
        load_case(case(tmp_path, "MODEL_ARGS:\n  --num-layers: !!python/object/apply:os.system ['true']\n"))


def test_render_flags_values():
    assert render_flags({"--a": True, "--b": False, "--c": None, "--d": [1, 2], "--e": "x y"}, {}, where="w") == [
        "--a",
        "--d",
        "1",
        "2",
        "--e",
        "x y",
    ]


@pytest.mark.skipif(not MEGATRON_LM.is_dir(), reason="needs the Megatron-LM mirror (fetched for reading, not vendored)")
def test_megatron_lms_own_graph_case_loads(tmp_path):
    import subprocess

    name = "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph"
    text = subprocess.run(
        [
            "git",
            "-C",
            str(MEGATRON_LM),
            "show",
            f"core_r0.19.0:tests/functional_tests/test_cases/moe/{name}/model_config.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    loaded = load_case(case(tmp_path, text, name))
    assert loaded.resumes  # a ckpt-resume case: the farm runs both halves
    flags = loaded.flags(
        {
            "DATA_PATH": "/data",
            "TENSORBOARD_PATH": "/tb",
            "CHECKPOINT_SAVE_PATH": "/ck",
            "CHECKPOINT_LOAD_PATH": "/ck",
            "DATA_CACHE_PATH": "/cache",
        }
    )
    index = flags.index("--cuda-graph-modules")
    assert flags[index + 1 : index + 5] == ["attn", "mlp", "moe_router", "moe_preprocess"]
    assert flags[flags.index("--fp8-recipe") + 1] == "blockwise"


# ---------------------------------------------------------------- --fit-gpus

from megatron_cg_plugin.farm.cases import fit_gpus  # noqa: E402

MOE_CASE = {
    "--tensor-model-parallel-size": 4,
    "--pipeline-model-parallel-size": 2,
    "--expert-model-parallel-size": 2,
    "--expert-tensor-parallel-size": 2,
    "--pipeline-model-parallel-layout": "Et|(tt|)*6mL",
    "--sequence-parallel": True,
    "--num-experts": 8,
    "--micro-batch-size": 2,
    "--global-batch-size": 32,
}


@pytest.mark.parametrize(
    "model_args, gpus, expected, changed",
    [
        # Megatron-LM's scoped-graph MoE case (TP4 PP2 EP2 ETP2, 8 GPUs) on one GPU.
        (
            MOE_CASE,
            1,
            {
                "--tensor-model-parallel-size": 1,
                "--pipeline-model-parallel-size": 1,
                "--expert-model-parallel-size": 1,
                "--expert-tensor-parallel-size": 1,
                "--num-experts": 8,
                "--micro-batch-size": 2,
                "--global-batch-size": 32,
            },
            ["--pipeline-model-parallel-layout", "--sequence-parallel dropped"],
        ),
        # The same on 2 GPUs keeps TP 2 and its sequence parallelism.
        (
            MOE_CASE,
            2,
            {
                "--tensor-model-parallel-size": 2,
                "--pipeline-model-parallel-size": 1,
                "--expert-model-parallel-size": 1,
                "--expert-tensor-parallel-size": 2,
                "--sequence-parallel": True,
                "--num-experts": 8,
                "--micro-batch-size": 2,
                "--global-batch-size": 32,
            },
            ["--tensor-model-parallel-size 4 -> 2"],
        ),
        # A DP-only case: 8 ranks of DP become 1, the global batch keeps its 4 microbatches per rank.
        (
            {"--micro-batch-size": 4, "--global-batch-size": 128},
            1,
            {"--micro-batch-size": 4, "--global-batch-size": 16},
            ["--global-batch-size 128 -> 16"],
        ),
        # Fitting already in its parallel sizes: written for 8 GPUs (DP 4), so on 2 the global batch shrinks.
        (
            {"--tensor-model-parallel-size": 2, "--micro-batch-size": 1, "--global-batch-size": 8},
            2,
            {"--tensor-model-parallel-size": 2, "--micro-batch-size": 1, "--global-batch-size": 2},
            ["--global-batch-size 8 -> 2"],
        ),
        # Written for the GPUs at hand: nothing changes.
        (
            {"--tensor-model-parallel-size": 2, "--micro-batch-size": 1, "--global-batch-size": 8},
            8,
            {"--tensor-model-parallel-size": 2, "--micro-batch-size": 1, "--global-batch-size": 8},
            [],
        ),
    ],
)
def test_fit_gpus_table(model_args, gpus, expected, changed):
    fitted, changes = fit_gpus(model_args, gpus)
    assert fitted == expected
    assert all(any(piece in change for change in changes) for piece in changed), changes
    if not changed:
        assert changes == []
    tp, pp, cp = (
        fitted.get(flag, 1)
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
    )
    assert gpus % (tp * pp * cp) == 0


@given(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4]),
)
def test_fit_gpus_always_fits(gpus, tp, pp, ep, cp):
    fitted, _ = fit_gpus(
        {
            "--tensor-model-parallel-size": tp,
            "--pipeline-model-parallel-size": pp,
            "--expert-model-parallel-size": ep,
            "--context-parallel-size": cp,
            "--micro-batch-size": 1,
            "--global-batch-size": 64,
        },
        gpus,
    )
    size = lambda flag: fitted.get(flag, 1)  # noqa: E731
    assert (
        gpus
        % (
            size("--tensor-model-parallel-size")
            * size("--pipeline-model-parallel-size")
            * size("--context-parallel-size")
        )
        == 0
    )
    assert (
        gpus
        % (
            size("--expert-model-parallel-size")
            * size("--expert-tensor-parallel-size")
            * size("--pipeline-model-parallel-size")
        )
        == 0
    )
    assert size("--tensor-model-parallel-size") <= tp and size("--expert-model-parallel-size") <= ep


def test_fit_gpus_refuses_zero():
    with pytest.raises(CaseError, match="--fit-gpus 0"):
        fit_gpus({}, 0)
