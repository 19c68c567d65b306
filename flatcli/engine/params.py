"""Parameter subsets: which parameters every measure perturbs and differentiates.

``params: {include: [glob, ...], exclude: [glob, ...]}`` matches the names of
``model.named_parameters()`` with `fnmatch` (shell wildcards: ``head.*``,
``transformer.h.*.attn.*``, ``*.lora_*``). A parameter is selected when it is
trainable (``requires_grad``), matches some ``include`` pattern (default: every
name) and no ``exclude`` pattern. Tied parameters (one tensor under two names, as
GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) are one parameter:
``named_parameters()`` lists the tensor once, under its first name, and a pattern
matching any of its names selects it. Unselected parameters stay fixed at their
values (they are part of the model, not of θ).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class ParamSelection:
    """Glob patterns over parameter names (see the module docstring)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    where: str = field(default="params", compare=False)

    @classmethod
    def of(cls, spec) -> ParamSelection:
        """A selection from None (everything), a `ParamSelection`, or a mapping with
        ``include``/``exclude`` lists of patterns (a single string is one pattern)."""
        if spec is None:
            return cls()
        if isinstance(spec, ParamSelection):
            return spec
        if hasattr(spec, "include") and hasattr(spec, "exclude"):
            spec = {"include": spec.include, "exclude": spec.exclude}
        if not isinstance(spec, dict):
            raise ConfigError(
                f"params must be a mapping with 'include' and/or 'exclude' lists. Got {spec!r} instead."
            )
        unknown = set(spec) - {"include", "exclude"}
        if unknown:
            raise ConfigError(
                f"Unknown config key 'params.{sorted(unknown)[0]}'. Valid keys here: include, exclude."
            )
        return cls(
            include=_patterns(spec.get("include"), "params.include"),
            exclude=_patterns(spec.get("exclude"), "params.exclude"),
        )

    @property
    def everything(self) -> bool:
        """Whether the selection is every trainable parameter."""
        return not self.include and not self.exclude

    def select(self, model: torch.nn.Module) -> list[str]:
        """The selected trainable parameter names, in ``named_parameters()`` order (tied ones once).

        Raises a `ConfigError` when a pattern matches no parameter, or nothing is selected,
        naming a few of the model's parameters."""
        aliases = _aliases(model)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        for pat in self.include + self.exclude:
            if not any(fnmatch.fnmatchcase(a, pat) for n in trainable for a in aliases[n]):
                raise ConfigError(
                    f"params: the pattern {pat!r} matches no trainable parameter; "
                    f"the model has {_examples(trainable)}"
                )

        def picked(n: str) -> bool:
            names = aliases[n]
            inc = not self.include or any(
                fnmatch.fnmatchcase(a, p) for a in names for p in self.include
            )
            exc = any(fnmatch.fnmatchcase(a, p) for a in names for p in self.exclude)
            return inc and not exc

        out = [n for n in trainable if picked(n)]
        if not out:
            raise ConfigError(
                f"params selects no trainable parameter; the model has {_examples(trainable)}"
            )
        return out

    def describe(self, model: torch.nn.Module, names: Sequence[str]) -> dict:
        """What results.json records: the patterns, the selected names and their parameter count."""
        sizes = dict(model.named_parameters())
        return {
            "include": list(self.include),
            "exclude": list(self.exclude),
            "names": list(names),
            "tensors": len(names),
            "count": int(sum(sizes[n].numel() for n in names)),
        }


def _patterns(value, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"config key '{key}' must be a list of glob patterns. Got {value!r} instead.")


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each parameter's first name, every name it has (tied weights have several)."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        key = first.setdefault(id(p), n)
        out.setdefault(key, []).append(n)
    return out


def _examples(names: Sequence[str], k: int = 6) -> str:
    more = f", … ({len(names)} in all)" if len(names) > k else ""
    return ", ".join(names[:k]) + more if names else "no trainable parameters"
