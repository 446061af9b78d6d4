"""The one configuration loader (muloco/core/typed_json.py) on small blocks: JSON's types taken strictly,
every problem named by its dotted path in one message in the order of the file, blocks chosen by a
sibling, and the same checks when a block is built in Python."""
from dataclasses import dataclass
from typing import Literal

import pytest

from muloco.core.errors import ConfigError
from muloco.core.typed_json import ConfigBlock, ConfigProblems, Problem, field_default, load, set_path, setting


@dataclass(frozen=True)
class Inner(ConfigBlock):
    size: int = setting(2, ge=1, doc="how many")
    ratio: float = setting(0.5, ge=0, lt=1)


@dataclass(frozen=True)
class Small(ConfigBlock):
    width: int = setting(ge=1)


@dataclass(frozen=True)
class Large(Small):
    depth: int = setting(3, ge=1)


@dataclass(frozen=True)
class Outer(ConfigBlock):
    kind: Literal["small", "large"] = setting("small", casefold=True)
    shape: Small = setting(factory=lambda: Small(1), selected_by=("kind", {"small": Small, "large": Large}))
    flag: bool = False
    pair: tuple[float, float] = setting((0.1, 0.2), gt=0)
    inner: Inner = setting(factory=Inner)
    extra: Inner | None = None
    names: dict[str, str] = setting(factory=dict)
    limit: int = setting(10, ge=1)

    REFUSED = {"legacy": "it was removed"}

    def problems(self) -> list[Problem]:
        return [("inner.size", f"({self.inner.size}) cannot exceed limit ({self.limit})")] \
            if self.inner.size > self.limit else []


def _problems(block: dict) -> str:
    with pytest.raises(ConfigProblems) as raised:
        load(Outer, block, "outer")
    return str(raised.value)


def test_json_values_become_the_annotated_types():
    outer = load(Outer, {"kind": "Large", "shape": {"width": 4}, "pair": [1, 2], "extra": {"ratio": 0}}, "outer")
    assert outer == Outer("large", Large(4, 3), False, (1.0, 2.0), Inner(), Inner(2, 0.0), {}, 10)
    assert isinstance(outer.pair[0], float) and isinstance(outer.extra.ratio, float)
    # An absent selected block is the chosen one with its defaults (Small has none for width).
    with pytest.raises(ConfigProblems, match=r"^outer\.shape\.width is required$"):
        load(Outer, {}, "outer")


@pytest.mark.parametrize("block, message", [
    ({"flag": 1}, "outer.flag must be a boolean, got 1"),
    ({"limit": True}, "outer.limit must be an integer, got True"),
    ({"limit": 2.0}, "outer.limit must be an integer, got 2.0"),
    ({"inner": {"ratio": float("inf")}}, "outer.inner.ratio must be a finite number, got inf"),
    ({"inner": {"ratio": float("nan")}}, "outer.inner.ratio must be a finite number, got nan"),
    ({"inner": {"ratio": 1}}, "outer.inner.ratio must be in [0, 1), got 1"),
    ({"pair": [1]}, "outer.pair must be a list of 2, got [1]"),
    ({"pair": [1, "x"]}, "outer.pair[1] must be a number, got 'x'"),
    ({"pair": [1, -1]}, "outer.pair must be > 0, got [1, -1]"),
    ({"kind": "medium"}, "outer.kind must be one of 'small', 'large', got 'medium'"),
    ({"inner": 3}, "outer.inner must be an object, got 3"),
    ({"extra": []}, "outer.extra must be an object or null, got []"),
    ({"extra": {"size": 0}}, "outer.extra.size must be >= 1, got 0"),
    ({"names": {"a": 1}}, "outer.names.a must be a string, got 1"),
    ({"inner": {"sise": 3}}, "outer.inner.sise is not a known key: did you mean size?"),
    ({"zzz": 3}, "outer.zzz is not a known key (known: kind, shape, flag, pair, inner, extra, names, limit)"),
    ({"legacy": 3}, "outer.legacy is not supported: it was removed"),
    ({"shape": {"width": 1, "depth": 2}}, "outer.shape.depth is only for kind large"),
    ({"inner": {"size": 11}}, "outer.inner.size (11) cannot exceed limit (10)"),
])
def test_a_problem_is_named_by_its_dotted_path(block, message):
    block = {"shape": {"width": 1}, **block}
    assert _problems(block) == message


def test_every_problem_in_the_order_of_the_file():
    message = _problems({"limit": 0, "shape": {"width": 0}, "zzz": 1, "flag": "no"})
    assert message.split("; ") == ["outer.limit must be >= 1, got 0", "outer.shape.width must be >= 1, got 0",
                                   "outer.zzz is not a known key (known: kind, shape, flag, pair, inner, extra, "
                                   "names, limit)", "outer.flag must be a boolean, got 'no'"]


def test_origins_name_what_set_a_value():
    with pytest.raises(ConfigProblems, match=r"^--limit must be >= 1, got 0$"):
        load(Outer, {"shape": {"width": 1}, "limit": 0}, "outer", origins={"outer.limit": "--limit"})


def test_building_a_block_in_python_runs_the_same_checks():
    assert Outer(shape=Small(1), pair=[1, 2]).pair == (1.0, 2.0)  # normalised as the loader does
    # Cross-field checks run once every field has the right type, out of range or not.
    with pytest.raises(ConfigProblems, match=r"^limit must be >= 1, got 0; inner\.size \(2\) cannot exceed limit \(0\)$"):
        Outer(shape=Small(1), limit=0)
    with pytest.raises(ConfigProblems, match=r"^shape must be a Large, got a Small$"):
        Outer(kind="large", shape=Small(1))
    with pytest.raises(ConfigProblems, match=r"^inner\.size \(11\) cannot exceed limit \(10\)$"):
        Outer(shape=Small(1), inner=Inner(size=11))
    assert field_default(Outer, "limit") == 10 and field_default(Outer, "inner") == Inner()


def test_set_path_makes_the_objects_on_the_way():
    block = {"a": None}
    set_path(block, "a.b.c", 1)
    assert block == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize("content, message", [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ('{"a": 1, "a": 2}', "key 'a' is given twice"),
    ('{"a": ', "is not valid JSON"),
    ("[1]", "must hold a JSON object"),
])
def test_a_config_file_that_is_not_one_is_one_line(tmp_path, content, message):
    from muloco.core.typed_json import read_json_object
    (tmp_path / "ds.json").write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_json_object(tmp_path / "ds.json")


def test_a_config_path_that_is_a_device_or_a_folder_is_not_read(tmp_path):
    from muloco.core.typed_json import read_json_object
    for path in ("/dev/zero", tmp_path):
        with pytest.raises(ConfigError, match="is not a regular file"):
            read_json_object(path)
