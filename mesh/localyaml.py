"""The YAML of the local config, read as the reference's parser reads it: YAML 1.2's core schema,
duplicate keys refused, numbers that remember how they were written, local tags kept (`!Exact "x"`),
and bounds on nesting and aliases checked before anything is built.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any, cast

import yaml

from mesh.yamlvalues import Tagged, WrittenFloat, WrittenInt

__all__ = ["Tagged", "WrittenFloat", "WrittenInt", "check_shape", "load"]


# Bounds checked on the parser's events before anything is built, so that neither PyYAML's recursive
# composer nor our readers meet a document nested deeper than any real configuration (one is about
# ten levels deep), and a few hundred bytes of aliases cannot stand for millions of values.
MAX_DEPTH = 100
MAX_ALIASED_NODES = 100_000


def _shape_error(problem: str, event: yaml.Event) -> yaml.MarkedYAMLError:
    return yaml.MarkedYAMLError(problem=problem, problem_mark=cast(yaml.Mark, event.start_mark))


def check_shape(text: str, loader: type[Any] | None = None) -> None:
    """Refuse, as a marked YAML error, nesting deeper than `MAX_DEPTH`, an alias inside its own
    anchor (a recursive value), and aliases that together expand to more than `MAX_ALIASED_NODES`."""
    sizes: dict[str, int] = {}  # anchor -> the number of nodes its value expands to
    open_anchors: set[str] = set()
    stack: list[tuple[str | None, int]] = []  # open collections: (anchor, node count at the start)
    count = aliased = 0
    for event in yaml.parse(text, Loader=loader or StrictLoader):
        if isinstance(event, yaml.ScalarEvent):
            count += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                raise _shape_error(f"nested deeper than {MAX_DEPTH} levels", event)
            stack.append((event.anchor, count))
            count += 1
            if event.anchor is not None:
                open_anchors.add(event.anchor)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = stack.pop()
            if anchor is not None:
                sizes[anchor] = count - start
                open_anchors.discard(anchor)
        elif isinstance(event, yaml.AliasEvent) and event.anchor is not None:
            if event.anchor in open_anchors:
                raise _shape_error(f"recursive alias *{event.anchor} (inside its own anchor)", event)
            size = sizes.get(event.anchor, 1)  # an undefined one is reported by the composer
            count += size
            aliased += size
            if aliased > MAX_ALIASED_NODES:
                raise _shape_error(f"aliases expand to more than {MAX_ALIASED_NODES} values", event)


class _Strict:
    """PyYAML speaks YAML 1.1; the reference's parser speaks 1.2 and rejects duplicate keys.

    So `no`/`on` stay strings, `010` is ten, no timestamps appear, and a repeated key is an error.
    (The construction of both loaders below: PyYAML's own parser, and libyaml's.)
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:  # a list or mapping, also one inside a tag (`!Exact [1]`)
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found unhashable key",
                    key_node.start_mark,
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[misc,no-any-return]

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's constructors for explicit tags fail on bad text with whatever they hit (`!!float ''`
        # an IndexError, `!!timestamp nope` an AttributeError, `!!bool ''` a KeyError): name the value.
        try:
            return super().construct_object(node, deep)  # type: ignore[misc]
        except (ValueError, TypeError, AttributeError, LookupError, OverflowError):
            what = f"value {node.value!r}" if isinstance(node, yaml.ScalarNode) else "collection"
            raise yaml.constructor.ConstructorError(
                None, None, f"invalid {node.tag} {what}", node.start_mark
            ) from None


class StrictLoader(_Strict, yaml.SafeLoader):
    """The reference's YAML 1.2 on PyYAML's own parser: what says why a file is refused."""

    yaml_implicit_resolvers: dict[Any, Any] = {}

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner keeps a possible simple key per open `[`/`{` and re-walks them all for every
        # token it reads ahead: thousands of open brackets cost seconds before the first event.
        if self.flow_level >= MAX_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)


# The same on libyaml's parser where PyYAML was built with it: several times faster on a mesh of
# 100,000 workloads. A document it refuses is read again by `StrictLoader`, whose errors we keep.
FastLoader: type[Any] | None = None
if getattr(yaml, "__with_libyaml__", False):

    class CStrictLoader(_Strict, yaml.CSafeLoader):  # type: ignore[misc]
        yaml_implicit_resolvers: dict[Any, Any] = {}

    FastLoader = CStrictLoader


def _scalar_only(node: yaml.Node) -> yaml.ScalarNode:
    if not isinstance(node, yaml.ScalarNode):  # `!!int []`
        raise yaml.constructor.ConstructorError(None, None, f"{node.tag} needs a scalar", node.start_mark)
    return node


def _construct_int(loader: yaml.SafeLoader, tagged: yaml.Node) -> int:
    node = _scalar_only(tagged)
    text = loader.construct_scalar(node)
    digits = text.replace("_", "").lstrip("+-")
    try:
        magnitude = int(digits, 0) if digits[:2] in ("0o", "0x") else int(digits, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"invalid integer {text!r}", node.start_mark
        ) from None
    number = WrittenInt(-magnitude if text.startswith("-") else magnitude)
    number.text = text
    return number


def _construct_float(loader: yaml.SafeLoader, tagged: yaml.Node) -> float:
    node = _scalar_only(tagged)
    number = WrittenFloat(loader.construct_yaml_float(node))
    number.text = loader.construct_scalar(node)
    return number


def _text(value: str, node: yaml.Node) -> str:
    """A string as written: `"\\ud83d\\ude00"` (how JSON, `/config_dump` too, escapes one character
    above U+FFFF) is that one character, as in YAML 1.2; PyYAML reads two lone surrogates, which no
    encoder takes. A lone surrogate is an error."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise yaml.constructor.ConstructorError(
            None, None, "string with an unpaired surrogate escape (\\ud800-\\udfff)", node.start_mark
        ) from None


def _construct_str(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    return _text(loader.construct_yaml_str(_scalar_only(node)), node)


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
    value: object
    if isinstance(node, yaml.ScalarNode):
        value = _text(loader.construct_scalar(node), node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        assert isinstance(node, yaml.MappingNode)
        value = loader.construct_mapping(node, deep=True)
    return Tagged(suffix, value)


def _schema(loader: Any) -> None:
    """The YAML 1.2 core schema; the int resolver comes before the float one so that `80` is an int."""
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
        list("-+0123456789"),
    )
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+.0123456789"),
    )
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
    )
    loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
    loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
    loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
    loader.add_constructor("tag:yaml.org,2002:str", _construct_str)
    loader.add_multi_constructor("!", _construct_tagged)


_schema(StrictLoader)
if FastLoader is not None:
    _schema(FastLoader)


def load(text: str) -> Any:
    """The document of `text`; raises `yaml.YAMLError` (marked where it can) on what is refused."""
    if FastLoader is not None:
        try:
            check_shape(text, FastLoader)
            return yaml.load(text, Loader=FastLoader)
        except yaml.YAMLError:
            pass  # read again below: PyYAML's parser says why, as it always has
    check_shape(text)
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader
