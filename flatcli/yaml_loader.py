"""The one YAML reader of configs and experiment specs: PyYAML's safe loader (plain data only,
on libyaml when PyYAML was built with it) with bounds: a key given twice in one mapping is an
error naming it (not last-one-wins), aliases may add at most `MAX_ALIAS_VALUES` values to a
document (an alias bomb is refused in milliseconds, before anything is built), and a file is
read as bytes, at most `MAX_YAML_BYTES`, as UTF-8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

MAX_ALIAS_VALUES = 10_000  # values YAML aliases may add to a document (a billion-laughs bomb: 10⁹)
MAX_YAML_BYTES = 16 * 2**20  # a config or spec file larger than this is refused unread


class _Bounded:
    """A YAML loader's additions: a key given twice in one mapping is an error (not last-one-wins),
    and aliases may add at most `MAX_ALIAS_VALUES` values to the document (counted on the node
    graph before anything is built, so an alias bomb costs milliseconds)."""

    def get_single_data(self):
        """The document's data, after the alias bound is checked on its node graph."""
        node = self.get_single_node()
        if node is None:
            return None
        _check_aliases(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        """A mapping whose keys are distinct (merge keys ``<<`` may be overridden, as YAML says)."""
        seen: set = set()
        for key_node, _ in node.value:
            if (
                not isinstance(key_node, yaml.ScalarNode)
                or key_node.tag == "tag:yaml.org,2002:merge"
            ):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (given twice in one mapping)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded(root, sizes: dict[int, int]) -> int:
    """The values ``root`` holds once its aliases are expanded, memoised in ``sizes`` by node id
    (linear in the node graph, no recursion); a YAML error for an alias to an enclosing node."""
    todo, open_ = [(root, False)], set()
    while todo:
        n, ready = todo.pop()
        if ready:
            open_.discard(id(n))
            sizes[id(n)] = 1 + sum(sizes[id(k)] for k in _children(n))
            continue
        if id(n) in sizes:
            continue
        if id(n) in open_:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to a node that holds it", n.start_mark
            )
        open_.add(id(n))
        todo.append((n, True))
        todo.extend((k, False) for k in _children(n) if id(k) not in sizes)
    return sizes[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _distinct(node) -> int:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if id(n) not in seen:
            seen.add(id(n))
            todo.extend(_children(n))
    return len(seen)


def _check_aliases(root) -> None:
    """A YAML error naming the key whose aliases expand beyond `MAX_ALIAS_VALUES` values."""
    sizes: dict[int, int] = {}
    if _expanded(root, sizes) - _distinct(root) <= MAX_ALIAS_VALUES:
        return
    path, node = [], root
    while True:  # down to the deepest key still holding more than the bound
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if sizes[id(v)] > MAX_ALIAS_VALUES:
                    nxt, step = v, str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                if sizes[id(v)] > MAX_ALIAS_VALUES:
                    nxt, step = v, f"[{i}]"
                    break
        if nxt is None:
            break
        path.append(step)
        node = nxt
    key = ".".join(path).replace(".[", "[") or "the document"
    raise yaml.composer.ComposerError(
        None,
        None,
        f"aliases expand {key} to more than {MAX_ALIAS_VALUES:,} values (an alias bomb?)",
        node.start_mark,
    )


class BoundedLoader(_Bounded, yaml.SafeLoader):
    """PyYAML's safe loader with the bounds of `_Bounded`."""


class _FastBoundedLoader(_Bounded, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The same, on libyaml's parser when PyYAML was built with it."""


def safe_yaml(text: str) -> Any:
    """The data of a YAML text through `BoundedLoader` (plain data only; no duplicate keys, aliases
    bounded), on libyaml's parser when PyYAML was built with it: 8× faster on the experiment specs
    (ns_regularization's 6 kB: 13.4 → 1.6 ms)."""
    return yaml.load(text, Loader=_FastBoundedLoader)  # noqa: S506 (a safe loader)


def read_yaml(path: Path, what: str) -> Any:
    """The data of the YAML file ``path`` (`safe_yaml`); a one-line `ConfigError` naming ``what``
    and the file (and the line and column) for a file too large, not UTF-8 or not valid YAML."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_YAML_BYTES // 2**20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    try:
        return safe_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply") from None
