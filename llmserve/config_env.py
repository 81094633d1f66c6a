"""Service options from flags, then the environment, then defaults, and `--check-config`.

Every long option `--some-flag` of a service can also be given as `LLMSERVE_SOME_FLAG`, so a
container sets its configuration in `environment:` / a ConfigMap instead of a command line.
A flag on the command line wins over the variable, which wins over the parser's default.
The variable's text is converted and checked exactly like the flag's would be (type and
choices), and a bad value is reported under the variable's name.

`--check-config` parses and validates a configuration (the service's own checks included:
`validate` builds its config objects) and exits 0 without starting anything, or prints one
line naming the problem and exits 2. Tests and probes use it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

ENV_PREFIX = "LLMSERVE_"
CHECK_CONFIG_FLAG = "--check-config"
# Options that only make sense on a command line: help, and the check itself (a variable that
# turned every start of a container into a dry run would be a trap).
_NOT_FROM_ENV = {"--help", CHECK_CONFIG_FLAG}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class EnvConfigError(ValueError):
    """An `LLMSERVE_*` variable holds a value its flag would not accept."""


def env_name(option: str) -> str:
    """`--max-num-seqs` -> `LLMSERVE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _long_option(action: argparse.Action) -> str | None:
    for option in action.option_strings:
        if option.startswith("--") and not option.startswith("--no-"):
            return option
    return None


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise EnvConfigError(f"{name}: expected true or false, got {text!r}")


def _convert(action: argparse.Action, name: str, text: str) -> Any:
    """The value `text` stands for, as the flag `action` would have parsed it."""
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        return _parse_bool(name, text)
    if isinstance(action, argparse._StoreFalseAction):
        return not _parse_bool(name, text)
    if not isinstance(action, argparse._StoreAction) or action.nargs not in (None, "?"):
        raise EnvConfigError(f"{name}: this option cannot be set from the environment")
    converter = action.type if callable(action.type) else str
    try:
        value = converter(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise EnvConfigError(f"{name}: invalid value {text!r} ({exc})") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise EnvConfigError(f"{name}: invalid choice {text!r} (choose from {choices})")
    return value


def env_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every variable the parser reads, with the option it stands for."""
    options: dict[str, argparse.Action] = {}
    for action in parser._actions:
        option = _long_option(action)
        if option is None or option in _NOT_FROM_ENV or action.dest == argparse.SUPPRESS:
            continue
        options[env_name(option)] = action
    return options


def apply_env_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """Make each set `LLMSERVE_<FLAG>` the default of its flag (a flag given still wins)."""
    environ = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for name, action in env_options(parser).items():
        text = environ.get(name)
        if text is not None:
            defaults[action.dest] = _convert(action, name, text)
    parser.set_defaults(**defaults)


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Under --check-config a mistake is one line on stderr (argparse adds the usage too)."""

    def error(message: str) -> NoReturn:
        print(f"{parser.prog}: invalid configuration: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]


def parse_service_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    validate: Callable[[argparse.Namespace], object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse a service's options (flag > `LLMSERVE_*` > default) and, with --check-config,
    validate them and exit. `validate` raises ValueError naming the field it rejects."""
    parser.add_argument(
        CHECK_CONFIG_FLAG,
        action="store_true",
        help="parse and validate the configuration (flags and LLMSERVE_* variables), then exit",
    )
    parser.epilog = (
        f"Every --flag can also be set as {ENV_PREFIX}FLAG (upper case, '-' as '_'); "
        "a flag given on the command line wins."
    )
    if CHECK_CONFIG_FLAG in argv:
        _one_line_errors(parser)
    try:
        apply_env_defaults(parser, environ)
    except EnvConfigError as exc:
        parser.error(str(exc))
    args = parser.parse_args(list(argv))
    if validate is not None:
        try:
            validate(args)
        except ValueError as exc:
            parser.error(str(exc))
    if args.check_config:
        print(f"{parser.prog}: configuration ok")
        sys.exit(0)
    return args
