"""The configuration reference (docs/configuration.md) cannot drift: its `muloco` block, flag tables and
ds_config sections are what tools/config_reference.py renders from the settings' declarations (the trainer's
parser is generated from them too)."""
import re

from tools import config_reference
from trainer.config import build_parser


def test_the_reference_holds_the_rendered_ds_config_reference():
    text = config_reference.REFERENCE.read_text()
    assert config_reference.with_reference(text) == text, \
        "docs/configuration.md's ds_config reference is stale: run python tools/config_reference.py --write"


def test_the_reference_names_every_key_with_its_default():
    muloco = config_reference.render_muloco()
    for row in ("| `sync_interval` | `30` | an integer >= 1 | H inner steps between outer syncs |",
                "| `bits` | `4` | one of 2, 4, 8 | bits per value of the hidden matrices (statistical, linear) |"):
        assert row in muloco
    trainer = config_reference.render()
    assert "| `ns_steps` | `5` | an integer >= 1 |" in trainer
    assert "**`optimizer.params`** (type `muon`, also every key of type adamw)" in trainer


def test_the_muloco_block_comes_first_and_apart_from_the_trainers_rules():
    """A user of the DeepSpeed hook reads part 1 (the `muloco` block) without the trainer's refusals;
    the trainer's ds_config (part 2) points at it instead of repeating it."""
    muloco, trainer = config_reference.render_muloco(), config_reference.render()
    blocks = ["muloco", *(f"muloco.{name}" for name in ("compression", "streaming", "link", "pace", "auth", "elastic"))]
    assert re.findall(r"^\*\*`([a-z_.]+)`\*\*", muloco, re.M) == blocks
    assert "Refused" not in muloco and "zero_optimization" not in muloco
    assert "**`muloco" not in trainer and "Refused: `fp16`" in trainer
    assert "| `muloco` | absent | an object | the outer loop (part 1: the `muloco` block);" in trainer
    text = config_reference.REFERENCE.read_text()
    assert text.index(config_reference.MULOCO[0]) < text.index(config_reference.FLAGS[0]) \
        < text.index(config_reference.DS_CONFIG[0])


def test_the_flag_reference_is_the_parsers_with_each_settings_path():
    text = config_reference.render_flags()
    for row in ("| `--lr LR` | peak learning rate; the schedule scales it (ds_config optimizer.params.lr) |",
                "| `--arch paper/qwen3/llama` | paper (pre+post norms",
                "| `--keep-last KEEP_LAST` | keep the newest N checkpoints, latest and the one of the best validation "
                "loss (default: 3) |",
                "| `--ds_config DS_CONFIG` or `--deepspeed_config DS_CONFIG` or `--ds-config DS_CONFIG` | DeepSpeed JSON config (required) |"):
        assert row in text
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help"} <= set(re.findall(r"`(--[a-z][a-z0-9_-]*)", text))
    # The ds_config reference names each key's flag.
    assert "| `lr` | `0.003` | a number > 0 | peak learning rate; the schedule scales it (`--lr`) |" in \
        config_reference.render()
