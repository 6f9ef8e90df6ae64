"""The docs that users act on must cover what the code can raise and patch."""

import re
from pathlib import Path

from megatron_cg_plugin.helptext import flags_markdown_table
from megatron_cg_plugin.patching.ledger import PATCHES, markdown
from megatron_cg_plugin.rules import RULES, markdown_rows

ROOT = Path(__file__).resolve().parents[2]
TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def test_every_rule_is_in_troubleshooting():
    missing = [rule.name for rule in RULES if f"`{rule.name}`" not in TROUBLESHOOTING]
    assert not missing, f"add these rules to docs/troubleshooting.md: {missing}"


def test_the_rules_table_says_what_the_rules_say():
    assert markdown_rows() in TROUBLESHOOTING, (
        "docs/troubleshooting.md's rules table differs from rules.py: paste the output of "
        "python -c 'from megatron_cg_plugin.rules import markdown_rows; print(markdown_rows())'"
    )


def test_the_flag_pages_table_is_the_one_the_help_prints():
    # docs/flags.md sits in docs/, so the table's links to docs/ pages are relative to it there.
    table = flags_markdown_table().replace("](docs/", "](")
    assert table in (ROOT / "docs" / "flags.md").read_text(), (
        "docs/flags.md's plugin flag table differs from config.PLUGIN_FLAGS: paste the output of "
        "python -c 'from megatron_cg_plugin.helptext import flags_markdown_table; "
        'print(flags_markdown_table().replace("](docs/", "]("))\''
    )


def test_every_error_class_is_in_troubleshooting():
    defined = set()
    for path in (ROOT / "megatron_cg_plugin").rglob("*.py"):
        defined |= set(re.findall(r"^class (\w+(?:Error|Violation|Failure))\(", path.read_text(), re.M))
    missing = sorted(name for name in defined if name not in TROUBLESHOOTING)
    assert defined and not missing, f"document these errors in docs/troubleshooting.md: {missing}"


def test_every_patch_is_in_patches_doc():
    text = (ROOT / "docs" / "patches.md").read_text()
    missing = [patch.name for patch in PATCHES if f"`{patch.name}`" not in text or patch.where not in text]
    assert not missing, f"add these patches (name and attribute) to docs/patches.md: {missing}"


def test_the_patches_page_is_the_one_the_ledger_renders():
    assert (ROOT / "docs" / "patches.md").read_text() == markdown(), (
        "docs/patches.md differs from patching/ledger.py: regenerate it with "
        "python -c 'from megatron_cg_plugin.patching.ledger import markdown; print(markdown(), end=\"\")' "
        "> docs/patches.md"
    )
