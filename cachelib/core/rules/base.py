"""What every allocation rule shares: the :class:`Rule` base (the integers one layer cache keeps,
and its fast-forward protocol) and the :class:`LayerBytes` it reports."""

from __future__ import annotations

import copy
from dataclasses import dataclass

UNBOUNDED = 1 << 62  # "every coming 1-token update is regular"


def ceil_steps(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass
class LayerBytes:
    """One layer cache's state after an update."""

    kind: str
    tokens_held: int
    capacity: int
    bytes_allocated: int
    bytes_used: int


class Rule:
    """Base of the per-class rules: the integers of one layer cache."""

    kind = ""
    bounded = False  # True: the allocation can never pass a fixed size, whatever the updates

    def __init__(self, token_bytes: int, kind: str | None = None):
        self.token_bytes = token_bytes  # one token slot, whole batch, keys + values
        self.offset = 0
        if kind:  # the class it stands for, where a rule models several (DynamicLayer, ...)
            self.kind = kind

    # -- what the cache holds now
    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @property
    def tokens_held(self) -> int:
        raise NotImplementedError

    @property
    def bytes_allocated(self) -> int:
        return self.capacity * self.token_bytes

    @property
    def bytes_used(self) -> int:
        return self.tokens_held * self.token_bytes

    def state(self) -> LayerBytes:
        return LayerBytes(self.kind, self.tokens_held, self.capacity, self.bytes_allocated, self.bytes_used)

    # -- updates
    def update(self, n: int) -> int:
        """Replay an update of ``n`` tokens; return the transient peak bytes during it."""
        raise NotImplementedError

    def regular_steps(self) -> int:
        """How many coming 1-token updates change bytes affinely and never downward."""
        return 0

    def skip(self, k: int) -> None:
        """Apply ``k`` regular 1-token updates at once (``k <= regular_steps()``)."""
        raise NotImplementedError

    def settled(self) -> bool:
        """Whether every coming 1-token update leaves the bytes (and the peak) as they are."""
        return False

    # -- cycles of equal updates
    def cycle_key(self, n: int):
        """What decides how the coming ``n``-token updates (and, for ``n == 1``, the regular
        stretches between them) change this rule, the integer fields they shift excepted; equal
        keys mean equal changes. None: not known yet (a threshold ahead), never cycle."""
        return None

    def cycle_horizon(self, n: int) -> int:
        """How many coming ``n``-token updates the key decides (a limit ahead, such as a static
        buffer's end, is not in the key)."""
        return UNBOUNDED

    def fields(self) -> dict[str, int]:
        """The integer fields (nested rules' as ``name.field``), for shifting by whole cycles."""
        out: dict[str, int] = {}
        for name, value in vars(self).items():
            if isinstance(value, Rule):
                out.update({f"{name}.{k}": v for k, v in value.fields().items()})
            elif isinstance(value, int) and not isinstance(value, bool):
                out[name] = value
        return out

    def shift(self, delta: dict[str, int], times: int) -> None:
        """Add ``times * delta[field]`` to each field: the state ``times`` cycles later."""
        for name, d in delta.items():
            if d:
                *path, attr = name.split(".")
                obj = self
                for part in path:
                    obj = getattr(obj, part)
                setattr(obj, attr, getattr(obj, attr) + times * d)

    def copy(self) -> Rule:
        return copy.copy(self)  # every field is an int, a str or a bool
