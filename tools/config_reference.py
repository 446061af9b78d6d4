"""The references of docs/configuration.md, rendered from the settings' declarations: its first part,
the `muloco` block (muloco/diloco/config.py: what the DeepSpeed hook and the trainer both take), then
the trainer's own: its flags (its parser, generated from the flags declared beside the settings:
trainer/flags.py) and the rest of its ds_config (trainer/ds_config.py and the blocks it holds). Every key
with its default, what it accepts, its one-line doc and its flag, so no reference can drift from what
the code takes and checks.

    python tools/config_reference.py          # print them
    python tools/config_reference.py --write  # rewrite them in docs/configuration.md, between their markers

tests/test_config_reference.py checks that docs/configuration.md holds exactly these.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from pathlib import Path

from muloco.core.typed_json import blocks_in, describe, spec_of
from muloco.diloco.config import MuLoCoConfig
from trainer.config import build_parser
from trainer.ds_config import DsConfig

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
MULOCO = ("<!-- muloco-reference:begin (python tools/config_reference.py --write rewrites this section) -->",
          "<!-- muloco-reference:end -->")
FLAGS = ("<!-- flag-reference:begin (python tools/config_reference.py --write rewrites this section) -->",
         "<!-- flag-reference:end -->")
DS_CONFIG = ("<!-- config-reference:begin (python tools/config_reference.py --write rewrites this section) -->",
             "<!-- config-reference:end -->")


def render_flags() -> str:
    """The trainer's flags, a table per group of its parser, each with its help (defaults filled in)."""
    tables = []
    for group in build_parser()._action_groups:
        rows = [_flag_row(a) for a in group._group_actions if a.help is not argparse.SUPPRESS
                and "--help" not in a.option_strings]
        if rows:
            title = "**flags**" if group.title == "options" else f"**{group.title}**"
            tables.append("\n".join([title, "", "| flag | meaning |", "|---|---|", *rows]))
    return "\n\n".join(tables)


def _flag_row(action: argparse.Action) -> str:
    value = "/".join(map(str, action.choices)) if action.choices else action.metavar or (
        action.dest.upper() if action.nargs != 0 else None)
    if action.nargs == "+":
        value += " ..."
    names = " or ".join(f"`{o}{'' if value is None else ' ' + value}`" for o in action.option_strings)
    meaning = (action.help or "") % vars(action) + (" (required)" if action.required else "")
    return f"| {names} | {meaning.replace('|', '/')} |"


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "{}" if isinstance(value, dict) else "(below)"
    if f.default is dataclasses.MISSING:
        return "required"
    if f.default is None:
        return "absent"
    value = list(f.default) if isinstance(f.default, tuple) else f.default
    return f"`{value}`" if isinstance(value, str) and value else f"`{json.dumps(value)}`"


def _accepts(annotation, spec) -> str:
    accepts = describe(annotation).replace(" or null", "")  # null is "absent", the default column says
    accepts = re.sub(r"'([^']*)'", r"`\1`", accepts)  # choices as code
    return accepts + (f" {spec.range}" if spec.range is not None else "")


def _table(cls: type, path: str, skip: set[str] = frozenset()) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        spec = spec_of(f)
        flag = f" (`{spec.flag}`)" if spec.flag else ""
        lines.append(f"| `{f.name}` | {_default(f)} | {_accepts(hints[f.name], spec)} | "
                     f"{spec.doc.replace('|', '/')}{flag} |")
    return lines


def _sections(cls: type, path: str, apart: frozenset[str] = frozenset()) -> list[list[str]]:
    """`cls`'s table, then each block it holds, depth first in field order; the blocks of the fields
    named in `apart` have their own part of the reference (their row stays)."""
    refused = getattr(cls, "REFUSED", {})
    sections = [[f"**`{path}`**" if path else "**top level**", "", *_table(cls, path)]]
    if refused:
        sections[0] += ["", "Refused: " + "; ".join(f"`{k}` ({why})" for k, why in refused.items()) + "."]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in apart:
            continue
        child = f"{path}.{f.name}" if path else f.name
        selected = spec_of(f).selected
        if selected is not None:
            seen: dict[str, type] = {}
            for choice, block in selected.blocks.items():
                base = next((name for name, earlier in seen.items() if issubclass(block, earlier)), None)
                own = {g.name for g in dataclasses.fields(seen[base])} if base else set()
                note = f", also every key of {selected.by} {base}" if base else ""
                sections.append([f"**`{child}`** ({selected.by} `{choice}`{note})", "", *_table(block, child, own)])
                seen[choice] = block
            continue
        for block in blocks_in(hints[f.name]):
            sections += _sections(block, child)
    return sections


def render_muloco() -> str:
    """The `muloco` block and the blocks it holds."""
    return "\n\n".join("\n".join(section) for section in _sections(MuLoCoConfig, "muloco"))


def render() -> str:
    """The trainer's ds_config, but for the `muloco` block's keys (render_muloco)."""
    return "\n\n".join("\n".join(section) for section in _sections(DsConfig, "", apart=frozenset({"muloco"})))


def with_reference(text: str) -> str:
    for (begin, end), rendered in ((MULOCO, render_muloco()), (FLAGS, render_flags()), (DS_CONFIG, render())):
        before, found, rest = text.partition(begin)
        _, found_end, after = rest.partition(end)
        if not found or not found_end:
            raise SystemExit(f"{REFERENCE} has no {begin} ... {end} section")
        text = f"{before}{begin}\n\n{rendered}\n\n{end}{after}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite the sections in docs/configuration.md")
    args = p.parse_args(argv)
    if args.write:
        REFERENCE.write_text(with_reference(REFERENCE.read_text()))
    else:
        print("\n\n".join((render_muloco(), render_flags(), render())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
