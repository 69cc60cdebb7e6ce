"""Registry: the named choices of one kind (engines, loss families, image towers, data sources, schedules,
optimizers, precisions, report targets, SwitchBack variants), each owned by the component that gives the
names their meaning.

A name, its help text and what it means are registered together, in one place:

    SCHEDULES = Registry("--lr-scheduler")

    @SCHEDULES.register("cosine", help="cosine decay after warmup")
    def cosine_schedule(cfg, total_steps): ...

so the config asks the registry which names exist (and for its --help text) instead of keeping a list of its
own, and an unknown name fails with one line listing the registered ones. A prefix entry ("timm/" for any
timm optimizer) matches every name that starts with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from bigclip.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str  # the canonical name ("timm/" for a prefix entry)
    value: T
    help: str
    aliases: tuple[str, ...] = ()
    prefix: bool = False  # matches every name that starts with `name`
    shown_as: str | None = None  # how listings show it ("timm/<optimizer name>")

    @property
    def display(self) -> str:
        return self.shown_as or self.name


class Registry(Generic[T]):
    def __init__(self, flag: str, unknown: Callable[[list[str]], str] | None = None):
        """flag: the option that picks a name ("--engine"), for error lines. unknown: builds the advice of the
        unknown-name line from the listed names (default: "choose one of a, b, c")."""
        self.flag = flag
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}
        self._unknown = unknown or (lambda names: f"choose one of {', '.join(names)}")

    def register(
        self,
        name: str,
        value: T | None = None,
        *,
        help: str = "",
        aliases: tuple[str, ...] = (),
        prefix: bool = False,
        shown_as: str | None = None,
    ):
        """Register `value` under `name`; without a value, a decorator that registers what it decorates."""

        def add(v: T) -> T:
            for n in (name, *aliases):
                if n in self._entries or n in self._aliases:
                    raise ValueError(f"{self.flag}: {n!r} is registered twice")
            self._entries[name] = Entry(name, v, help, tuple(aliases), prefix, shown_as)
            self._aliases.update(dict.fromkeys(aliases, name))
            return v

        return add if value is None else add(value)

    def unregister(self, name: str) -> None:
        """Remove `name` and its aliases (an experiment's or a test's name, registered for a while)."""
        entry = self._entries.pop(name)
        for alias in entry.aliases:
            del self._aliases[alias]

    # -- lookups
    def _entry(self, name: str) -> Entry[T] | None:
        if not isinstance(name, str):
            return None
        name = self._aliases.get(name, name)
        if name in self._entries and not self._entries[name].prefix:
            return self._entries[name]
        return next((e for e in self._entries.values() if e.prefix and name.startswith(e.name)), None)

    def __contains__(self, name: object) -> bool:
        return self._entry(name) is not None  # type: ignore[arg-type]

    def entry(self, name: str) -> Entry[T]:
        """The entry `name` (or an alias of it) stands for; an unknown name is a UserError naming the flag."""
        found = self._entry(name)
        if found is None:
            raise UserError(f"{self.flag} {name!r}: {self.advice()}")
        return found

    def advice(self) -> str:
        """What the line about an unknown name advises: the registered names."""
        return self._unknown(self.names())

    def get(self, name: str) -> T:
        return self.entry(name).value

    def canonical(self, name: str) -> str:
        """The registered name behind an alias (a prefix entry keeps the full name: "timm/lamb")."""
        entry = self.entry(name)
        return name if entry.prefix else entry.name

    # -- listings
    def names(self) -> list[str]:
        """Every accepted name, aliases right after their entry, in registration order."""
        return [n for e in self._entries.values() for n in (e.display, *e.aliases)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return [(name, e.value) for name, e in self._entries.items()]

    def help(self) -> str:
        """--help text: each name with what it means."""
        parts = []
        for e in self._entries.values():
            names = " / ".join((e.display, *e.aliases))
            parts.append(f"{names}: {e.help}" if e.help else names)
        return "Choices: " + "; ".join(parts) + "."
