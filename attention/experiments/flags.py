"""One definition per run configuration: dataclass fields become ``abft`` flags, and back.

A configuration dataclass (:class:`attention.experiments.campaign.CampaignConfig`,
:class:`attention.experiments.train.TrainConfig`) declares each field with :func:`option`: its
default, help text and, where it has one, its flag name, its choices and its arity.  :func:`add_flags` turns the
fields into argparse options; :func:`from_args` builds the dataclass back from the parsed
namespace, so the dataclass's own validation (``__post_init__``) judges every value.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, *, flag: str | None = None,
           choices: Sequence[Any] | None = None, nargs: int | str | None = None,
           metavar: str | tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is also a command-line flag.

    Parameters
    ----------
    default : Any
        The field's default (a tuple for a field that takes several values).
    help : str
        Help text; the default is appended to it (``"all"`` when it equals ``choices``).
    flag : str, optional
        Flag name; defaults to ``--`` plus the field name with ``_`` replaced by ``-``.
    choices : sequence, optional
        Allowed values (of each element, for a tuple field); listed in the help.
    nargs : int or str, optional
        Arity of a tuple field (default ``"+"``).
    metavar : str or tuple of str, optional
        Placeholder(s) in the usage line.
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "flag": flag, "choices": None if choices is None else tuple(choices),
        "nargs": nargs, "metavar": metavar})


def add_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """Add one flag per :func:`option` field of the dataclass ``config`` to ``parser``."""
    for f in dataclasses.fields(config):
        meta = f.metadata
        if "help" not in meta:
            continue
        many = isinstance(f.default, tuple)
        sample = f.default[0] if many else f.default
        choices = meta["choices"]
        default_text = "all" if many and choices == f.default else _show(f.default)
        help_text = meta["help"]
        if choices is not None:
            help_text += "; one or more of: " if many else "; one of: "
            help_text += ", ".join(map(str, choices))
        kwargs: dict[str, Any] = {
            "dest": f.name, "type": type(sample), "default": f.default,
            "help": f"{help_text} (default: {default_text})", "metavar": meta["metavar"]}
        if many:
            kwargs["nargs"] = meta["nargs"] or "+"
        if choices is not None:
            kwargs["choices"] = choices
            kwargs["metavar"] = kwargs["metavar"] or f.name.rstrip("s").upper()
        parser.add_argument(meta["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


def from_args(config: type[T], args: argparse.Namespace) -> T:
    """Build the dataclass ``config`` from the flags :func:`add_flags` added.

    Raises
    ------
    ValueError
        From the dataclass's validation, for values its flags accept but it does not.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config)
              if "help" in f.metadata}
    return config(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
