"""Every flag is declared once, beside its setting (trainer/flags.py builds the parsers from the
declarations): the trainer's parser holds exactly the declared flags and a short list of launcher and
meta flags, and the planner takes the flags it shares with the trainer from the same declarations,
with the same defaults."""
import dataclasses
import typing

import pytest

from tools import plan as planner
from trainer import config
from muloco.diloco.config import CompressionConfig, MuLoCoConfig
from trainer.ds_config import DsConfig
from trainer.model.presets import PRESETS
from muloco.core.typed_json import ConfigBlock, field_default, spec_of

# Flags that set no one setting: the launcher's, the ds_config and model to start from, and the
# flags that compute or select several values.
META = {"--help", "--ds_config", "--deepspeed_config", "--ds-config", "--deepspeed", "--local_rank", "--local-rank", "--model",
        "--recipe", "--use-checkpoint-args", "--global-batch-size", "--optimizer", "--no-qk-layernorm"}


def _blocks(cls=ConfigBlock):
    """The trainer's config blocks (not the tests' own)."""
    for sub in cls.__subclasses__():
        if sub.__module__.startswith(("trainer.", "muloco.")):
            yield sub
        yield from _blocks(sub)


def _declared():
    """(block, field, flag) of every field of every config block that declares a flag (an inherited
    field under the block that declares it)."""
    return [(block, f, spec_of(f).flag) for block in set(_blocks()) for f in dataclasses.fields(block)
            if spec_of(f).flag is not None and f.name in block.__dict__.get("__annotations__", {})]


def _options(parser):
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def test_every_flag_of_the_parser_is_a_declared_setting_or_a_meta_flag():
    declared = {}
    for block, f, flag in _declared():
        for option in (flag, *spec_of(f).aliases):
            assert option not in declared, f"{option} is declared twice: {declared[option]} and {block.__name__}"
            declared[option] = f"{block.__name__}.{f.name}"
    options = _options(config.build_parser())
    assert set(options) - set(declared) - META == set()
    assert set(declared) - set(options) == set(), "a declared flag missing from the trainer's parser"
    assert META & set(declared) == set()
    # Each declared flag writes its field (argparse's dest), and no two flags write one dest.
    for block, f, flag in _declared():
        assert options[flag].dest == f.name, (flag, options[flag].dest)
    dests = [a.dest for a in config.build_parser()._actions]
    assert len(dests) == len(set(dests))


def test_a_switch_turns_its_setting_from_the_default():
    """--no-X exactly for the settings on by default; the switch sets the other value."""
    for block, f, flag in _declared():
        if typing.get_type_hints(block)[f.name] not in (bool, bool | None):
            continue
        assert flag.startswith("--no-") == (field_default(block, f.name) is True), flag
    args = config.build_parser().parse_args(["--ds_config", "x.json", "--no-load-rng", "--finetune",
                                             "--no-final-sync"])
    assert (args.load_rng, args.finetune, args.final_sync) == (False, True, False)
    plain = config.build_parser().parse_args(["--ds_config", "x.json"])
    assert (plain.load_rng, plain.finetune, plain.final_sync) == (True, False, None)  # None: the ds_config's


def test_the_ds_config_flags_are_its_fields_at_their_paths():
    paths = {f.name: f.path for f in config.DS_CONFIG_FLAGS}
    assert paths["--lr"] == "optimizer.params.lr" and paths["--clip-grad"] == "gradient_clipping"
    assert paths["--lr-warmup-iters"] == "scheduler.params.warmup_iters"
    raw, origins = config.with_flags({"muloco": {}}, config.build_parser().parse_args(
        ["--ds_config", "x.json", "--lr", "0.5", "--micro-batch-size", "3", "--emulate-slowdown", "1", "2"]))
    assert raw == {"muloco": {"emulate_slowdown": [1.0, 2.0]}, "optimizer": {"params": {"lr": 0.5}},
                   "train_micro_batch_size_per_gpu": 3}
    assert origins == {"optimizer.params.lr": "--lr", "train_micro_batch_size_per_gpu": "--micro-batch-size",
                       "muloco.emulate_slowdown": "--emulate-slowdown"}


def test_the_planner_shares_the_trainers_flags():
    trainer, plan = _options(config.build_parser()), _options(planner.build_parser())
    ds_config = {"--ds_config", "--deepspeed_config", "--ds-config"}  # required by the trainer alone
    assert {trainer[o].dest for o in ds_config} == {plan[o].dest for o in ds_config} == {"ds_config"}
    shared = set(trainer) & set(plan) - {"--help", "--model"} - ds_config
    assert shared == {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                      "--global-batch-size", "--seq-length", "--vocab-size"}
    for option in shared:
        a, b = trainer[option], plan[option]
        assert (a.option_strings, a.dest, a.type, a.choices, a.nargs, a.help.split(" (")[0]) == \
               (b.option_strings, b.dest, b.type, b.choices, b.nargs, b.help.split(" (")[0]), option
    # The planner's own flags are typed by their settings' declarations too.
    assert plan["--collective"].choices == typing.get_args(typing.get_type_hints(MuLoCoConfig)["collective"])
    assert plan["--error-feedback"].const is True and plan["--error-feedback"].default is None


@pytest.mark.parametrize("model", ["tiny", "150m"])
def test_the_planners_defaults_are_the_settings(model):
    """No flag and no ds_config: the values the trainer would take (the run's T and P, the ds_config's
    micro-batch, the preset's sequence length, the compression block's error feedback)."""
    plain = planner.inputs_from_args(planner.build_parser().parse_args(["--model", model]))
    assert (plain.sizes.tensor, plain.sizes.pipeline) == (field_default(config.RunConfig, "tensor_parallel"),
                                                          field_default(config.RunConfig, "pipeline_parallel"))
    assert plain.micro_batch == field_default(DsConfig, "train_micro_batch_size_per_gpu")
    assert plain.seq_length == PRESETS[model].seq_length
    compressed = planner.inputs_from_args(planner.build_parser().parse_args(
        ["--model", model, "--compression", "statistical:4"]))
    assert compressed.compression.error_feedback is field_default(CompressionConfig, "error_feedback")
    on = planner.inputs_from_args(planner.build_parser().parse_args(
        ["--model", model, "--compression", "statistical:4", "--error-feedback"]))
    assert on.compression.error_feedback is True


def test_generated_flags_parse_as_their_fields_type():
    args = config.build_parser().parse_args(["--ds_config", "x.json", "--data-path", "1", "a", "--arch", "llama",
                                             "--distributed-backend", "gloo", "--hang-timeout-s", "5"])
    assert (args.data_path, args.arch, args.distributed_backend, args.hang_timeout_s) == (
        ["1", "a"], "llama", "gloo", 5.0)
    with pytest.raises(SystemExit):
        config.build_parser().parse_args(["--ds_config", "x.json", "--arch", "gpt2"])
