"""The product names no lab notes: no run id, work session, dated results folder, issue number of this
project or remark about which machines were available, in the README, docs/, benchmarks/ (text), the
package's code or the tests. Figures live in benchmarks/*/result.json; upstream references (Megatron-LM #5619,
TE #3353, TransformerEngine #2543, Megatron-Bridge #3500) stay allowed. Committed JSON under benchmarks/ and
tests/ holds no raw run output either: no host path, Python traceback or log timestamp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = (
    r"(?:Megatron-LM|Megatron-Bridge|Megatron|megatron-core|TransformerEngine|Transformer Engine|TE"
    r"|PyTorch|torch|cuDNN|NCCL)"
)
PATTERNS = {
    # s81, s102, s100a, s66-s69: a run id as a word of its own (not s1, not inside hex such as 5s81ab or a path)
    "run id": re.compile(r"(?<![\w./])s\d{2,3}[a-d]?(?!\w)"),
    "work session": re.compile(r"session-20\d\d"),
    "dated folder": re.compile(r"[A-Za-z0-9]-20\d\d-\d\d-\d\d\b"),
    "results folder": re.compile(r"docs/results"),
    "machines lent": re.compile(
        r"\b(?:machines?|devices?|GPUs?|H100s?|H200s?) (?:were |was )?lent\b|\blent (?:H\d00|GPU|"
        r"machine|device)|\bno (?:device|GPU|machine) was\b|calls? were refused|"
        r"device refused|1-GPU machines",
        re.I,
    ),
}


# This project's issues: "issue 31", "issue-30", "#31". An upstream project's name right before the number
# (Megatron-LM #5619, Megatron-LM issue 5619) makes it upstream.
ISSUE = re.compile(r"\b[Ii]ssues?[ -]#?\d+\b|(?<![\w&/])(?<!forward )(?<!backward )(?<!frame )(?<!step )#\d{1,3}\b")
UPSTREAM_BEFORE = re.compile(rf"\b{UPSTREAM}(?: [Ii]ssues?)? $")


# Raw run output in committed JSON (the published results, the support matrix's runs, the farm's golden values):
# a host's paths, a Python traceback, a log line's timestamp. A published file keeps what its renderer reads;
# a run's logs stay in the folder it wrote them to.
RAW_OUTPUT = {
    "host path": re.compile(r"(?<![\w.~$-])/(?:root|tmp|opt|home)/"),
    # the header, or a frame (File "...", line N) of a traceback cut to its tail; in JSON the quotes are escaped
    "traceback": re.compile(r'Traceback \(most recent call last\)|\bFile \\?"[^"\n]+?\\?", line \d+'),
    "log timestamp": re.compile(r"\b20\d\d-\d\d-\d\d[ T]\d\d:\d\d:\d\d"),
}


def raw_output(text: str) -> list[tuple[str, str]]:
    """(kind, an excerpt) for every piece of raw run output in text."""
    return [
        (kind, text[max(match.start() - 40, 0) : match.end() + 40].replace("\n", " "))
        for kind, pattern in RAW_OUTPUT.items()
        for match in pattern.finditer(text)
    ]


def _json_files() -> list[Path]:
    return sorted(path for area in ("benchmarks", "tests") for path in (ROOT / area).rglob("*.json") if path.is_file())


def _our_issue(line: str) -> bool:
    return any(not UPSTREAM_BEFORE.search(line[: match.start()]) for match in ISSUE.finditer(line))


def _files(area: str) -> list[Path]:
    if area == "README":
        return [ROOT / "README.md"]
    if area == "docs":
        return sorted((ROOT / "docs").rglob("*.md"))
    if area == "benchmarks":
        return sorted(p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and p.suffix != ".json")
    if area == "tests":
        # The farm's case files too (their comments are product text); not tests/unit/_cases/, which copies
        # Megatron-LM's own case files verbatim, nor the golden values (.json).
        cases = (ROOT / "tests/functional/test_cases").rglob("*")
        return sorted([*(ROOT / "tests").rglob("*.py"), *(p for p in cases if p.is_file() and p.suffix != ".json")])
    return sorted((ROOT / "megatron_cg_plugin").rglob("*.py"))


def lab_notes(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the line) for every line of text that reads as a lab note."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append((number, kind, line.strip()))
        if _our_issue(line):
            found.append((number, "issue number", line.strip()))
    return found


@pytest.mark.parametrize("area", ["README", "docs", "benchmarks", "tests", "megatron_cg_plugin"])
def test_no_lab_notes(area):
    this = Path(__file__).resolve()
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {kind}: {line[:120]}"
        for path in _files(area)
        if path.resolve() != this
        for number, kind, line in lab_notes(path.read_text(errors="replace"))
    ]
    assert not hits, "lab notes in the product (figures go to benchmarks/*/result.json):\n" + "\n".join(hits)


def test_no_raw_run_output_in_committed_json():
    hits = [
        f"{path.relative_to(ROOT)}: {kind}: ...{excerpt}..."
        for path in _json_files()
        for kind, excerpt in raw_output(path.read_text(errors="replace"))
    ]
    assert not hits, "raw run output (a log, a traceback, a host's path) in committed JSON:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "text",
    [
        '"log": "/root/out/f/bench/gpt_layer_bf16_te_1/bench.log"',
        '  File \\"/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/launcher/api.py\\", line 284',
        "/home/user/Megatron-LM/pretrain_gpt.py",
        "--data-path /tmp/data/synthetic_text_document",
        "Traceback (most recent call last):\\n  File",
        'File "train.py", line 12, in <module>',
        '\\n  File \\"<string>\\", line 5, in <module>',
        "[after dataloaders are built] datetime: 2026-12-02 17:34:52.832377",
        "2026-12-02T17:34:52Z starting",
    ],
)
def test_the_raw_output_patterns_catch_logs(text):
    assert raw_output(text)


@pytest.mark.parametrize(
    "text",
    [
        '"command": "megatron-cg farm tests/functional/test_cases/gpt/tiny_gpt_attn --out OUT/farm"',
        "--data-path $OUT/data/synthetic_text_document",
        "https://github.com/NVIDIA/Megatron-LM/blob/core_r0.19.0/megatron/core/transformer/transformer_config.py",
        "megatron/core/transformer/transformer_config.py:2627",
        "docs/troubleshooting.md",
        "the eager run from the graphed run's checkpoint",
        "released 2026-12-02",
    ],
)
def test_the_raw_output_patterns_leave_results_alone(text):
    assert not raw_output(text)


@pytest.mark.parametrize(
    "line",
    [
        "measured in s81 on the 12x1024 bench",
        "runs s66-s69",
        "s102 (1x H200): Llama-like",
        "s100a and s100c",
        "see issue 31",
        "issue-30's shape",
        "fixed in #31",
        "docs/results/offload-2026-12-01/README.md",
        "session-2026-12-05c",
        "results/planner-fp8-2026-12-01",
        "only 1-GPU machines were lent",
        "no device was lent",
        "the device refused every later call; calls were refused",
    ],
)
def test_the_patterns_catch_lab_notes(line):
    assert lab_notes(line)


@pytest.mark.parametrize(
    "line",
    [
        "Megatron-LM #5619",
        "TE #3353",
        "TransformerEngine #2543",
        "Megatron-Bridge #3500",
        "Megatron-LM issue 5619",
        "attributes lent until uninstall() (LENT, through patches.lend)",
        "sm90 and s1, s2 shares",
        "0x5s81ab",
        "--router-load s1,s2,...",
        "a 4096-token pass",
        "torch >= 2.9",
        "sha256 e3b0c442",
        "`cu_seqlens` of 128 entries",
        "the cells were refused by rule slot-capture-fp8",
        "owned by variant 'cp1' (forward #1)",
        "no device read",
        "the profiled device time per step",
        "uninstall() then restores what was lent",
    ],
)
def test_the_patterns_leave_product_text_alone(line):
    assert not lab_notes(line)
