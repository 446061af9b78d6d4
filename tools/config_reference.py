"""The ds_config reference of docs/configuration.md, rendered from the config dataclasses (trainer/ds_config.py and
the blocks it holds): every key with its default, what it accepts and its one-line doc, so the
reference cannot drift from what the loader checks.

    python tools/config_reference.py          # print it
    python tools/config_reference.py --write  # rewrite it in docs/configuration.md, between its markers

tests/test_config_reference.py checks that docs/configuration.md holds exactly this.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from pathlib import Path


from trainer.ds_config import DsConfig
from trainer.typed_json import ConfigBlock, describe, spec_of

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- config-reference:begin (python tools/config_reference.py --write rewrites this section) -->"
END = "<!-- config-reference:end -->"


def _blocks_in(annotation) -> list[type]:
    """The config blocks a field's annotation holds (itself, or the non-null side of X | None)."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigBlock):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [b for a in typing.get_args(annotation) for b in _blocks_in(a)]
    return []


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
        lines.append(f"| `{f.name}` | {_default(f)} | {_accepts(hints[f.name], spec)} | "
                     f"{spec.doc.replace('|', '/')} |")
    return lines


def _sections(cls: type, path: str) -> list[list[str]]:
    """`cls`'s table, then each block it holds, depth first in field order."""
    refused = getattr(cls, "REFUSED", {})
    sections = [[f"**`{path}`**" if path else "**top level**", "", *_table(cls, path)]]
    if refused:
        sections[0] += ["", "Refused: " + "; ".join(f"`{k}` ({why})" for k, why in refused.items()) + "."]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
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
        for block in _blocks_in(hints[f.name]):
            sections += _sections(block, child)
    return sections


def render() -> str:
    return "\n\n".join("\n".join(section) for section in _sections(DsConfig, ""))


def with_reference(text: str) -> str:
    before, begin, rest = text.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{REFERENCE} has no {BEGIN} ... {END} section")
    return f"{before}{BEGIN}\n\n{render()}\n\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite the section in docs/configuration.md")
    args = p.parse_args(argv)
    if args.write:
        REFERENCE.write_text(with_reference(REFERENCE.read_text()))
    else:
        print(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
