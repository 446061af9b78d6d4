"""The configuration reference (docs/configuration.md) cannot drift: its ds_config section is what
tools/config_reference.py renders from the config dataclasses, and every flag of the trainer's
parser is in its flag table."""
import re

from tools import config_reference
from trainer.config import build_parser


def test_the_reference_holds_the_rendered_ds_config_reference():
    text = config_reference.REFERENCE.read_text()
    assert config_reference.with_reference(text) == text, \
        "docs/configuration.md's ds_config reference is stale: run python tools/config_reference.py --write"


def test_the_reference_names_every_key_with_its_default():
    text = config_reference.render()
    for row in ("| `sync_interval` | `30` | an integer >= 1 | H inner steps between outer syncs |",
                "| `bits` | `4` | one of 2, 4, 8 | bits per value of the hidden matrices (statistical, linear) |",
                "| `ns_steps` | `5` | an integer >= 1 |"):
        assert row in text
    assert "**`optimizer.params`** (type `muon`, also every key of type adamw)" in text


def test_every_flag_is_in_the_reference_flag_table():
    text = config_reference.REFERENCE.read_text()
    table = text[text.index("Command-line flags use Megatron's names"):text.index("Every value is checked")]
    documented = set(re.findall(r"--[a-z][a-z0-9_-]*", table))
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    hidden = {"--help", "--local_rank", "--local-rank", "--deepspeed_config"}  # set by the launcher, or aliases
    assert flags - hidden - documented == set()
