"""A spec's options, each declared once, as a field of the spec's dataclass: its name (the
field's), its type (the field's annotation), its default, bounds and help (``option``). The
command line's flags (``lorabench.cli``), a spec file's keys and the checks of their values
(``lorabench.config.spec``) and the columns every row copies from its job
(``lorabench.runtime.worker``) are all read off the same declarations (``options_of``).

Values arrive as text (a flag) or as TOML values (a spec file); ``Option.parse`` turns either
into the field's type, or one ``UserError`` line naming the flag (``lorabench.config.flags``)."""

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum

from lorabench.config.flags import flag, to_bool, to_int, to_ints, to_positive, to_strs


class Kind(Enum):
    """What an option's value is, from its field's annotation."""

    INTS = list[int]  # comma-separated text, or a TOML list
    NAMES = list[str]
    INT = int
    NUMBER = float  # a positive number
    FLAG = bool
    TEXT = str


@dataclass(frozen=True)
class Option:
    """One option: what ``option`` declares, with the name and kind of its field."""

    name: str
    kind: Kind
    help: str  # one sentence, without the default or the final full stop
    default: object = None  # the value when not given (None: unset, or resolved on the machine)
    shown: str | None = None  # the help's "[default: ...]" when the default is not a plain value
    minimum: int = 1  # INT, INTS
    maximum: int | None = None  # INT
    aliases: tuple[str, ...] = ()  # other names of it: flags, and keys of a spec file (vLLM's names)
    column: bool = False  # every row carries the job's value under the option's name

    @property
    def flags(self) -> tuple[str, ...]:
        """Its spellings on the command line. A flag that is on by default is turned off by ``--no-<name>``."""
        if self.kind is Kind.FLAG and self.default is True:
            return ("--no-" + flag(self.name)[2:],)
        return (flag(self.name), *map(flag, self.aliases))

    def describe(self) -> str:
        """Its help as ``--help`` prints it: the sentence, then its default."""
        default = self.shown
        if default is None and self.default is not None and self.kind is not Kind.FLAG:
            default = ",".join(map(str, self.default)) if isinstance(self.default, list) else str(self.default)
        return self.help + (f" [default: {default}]." if default is not None else ".")

    def parse(self, value) -> object:
        """A flag's text or a spec file's value -> the field's type (comma strings become lists)."""
        if self.kind is Kind.INTS:
            return to_ints(self.name, value, self.minimum)
        if self.kind is Kind.NAMES:
            return to_strs(self.name, value)
        if self.kind is Kind.INT:
            return to_int(self.name, value, self.minimum, self.maximum)
        if self.kind is Kind.NUMBER:
            return to_positive(self.name, value)
        if self.kind is Kind.FLAG:
            return to_bool(self.name, value)
        return str(value)


def option(default, help: str, *, shown: str | None = None, minimum: int = 1, maximum: int | None = None,
           aliases: tuple[str, ...] = (), column: bool = False):
    """A spec field that is an option (``Option`` says what each argument is)."""
    details = dict(help=help, default=default, shown=shown, minimum=minimum, maximum=maximum, aliases=aliases,
                   column=column)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"option": details})
    return field(default=default, metadata={"option": details})


def _kind(annotation) -> Kind:
    """``list[int]``, ``int | None``, ... -> its Kind (None is "not given", not a kind)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return Kind(annotation)


def options_of(cls) -> dict[str, Option]:
    """The options a dataclass declares (its fields made by ``option``), in declaration order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if "option" in f.metadata:
            details = dict(f.metadata["option"])
            if f.default_factory is not MISSING:
                details["default"] = f.default_factory()
            out[f.name] = Option(f.name, _kind(hints[f.name]), **details)
    return out


def aliases(options: dict[str, Option]) -> dict[str, str]:
    """Every other name of an option (underscored) -> the option's name."""
    return {a: o.name for o in options.values() for a in o.aliases}
