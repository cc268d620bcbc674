"""The command lines of the island roles (coordinator, executor, worker):
absl flags, and a mistake on the command line as one line.

Each role defines its flags on a `FlagValues` of its own, not absl's global
FLAGS: the role modules are also imported together in one process (the
launcher, tests), where two roles' `--store` would collide. `--help` prints
the role's flags; a flag absl refuses (unknown, a bad value, a required one
missing) is one line naming it, status 2 (with `--verbose`, absl's
exception). What the role then raises goes through `layout.role_errors`.
"""

import re
import sys
from typing import Callable

from absl import flags


def parse(role: str, doc: str, define: Callable[[flags.FlagValues], None],
          argv=None) -> flags.FlagValues:
  """The parsed flags of `role` (its `define(flag_values)`), from `argv`
  (sys.argv by default). `doc`: the role module's docstring, whose first
  line heads --help."""
  argv = list(sys.argv if argv is None else argv)
  flag_values = flags.FlagValues()
  flags.DEFINE_bool("verbose", False, "absl's exception for a flag it "
                    "refuses, not one line",
                    flag_values=flag_values)
  define(flag_values)
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(_help(doc, flag_values))
    sys.exit(0)
  try:
    flag_values(argv)
  except flags.Error as e:
    if "--verbose" in argv:
      raise
    line = str(e).splitlines()[0]
    missing = _MISSING.search(line)
    if missing:
      line = f"--{missing[1]} is required"
    print(f"[{role}] error: {line} (see --help)", file=sys.stderr,
          flush=True)
    sys.exit(2)
  return flag_values


# absl's words for a required flag left out.
_MISSING = re.compile(r"Flag --(\w+) must have a value other than None")


def _help(doc: str, flag_values: flags.FlagValues) -> str:
  lines = [" ".join(doc.strip().split("\n\n")[0].split()), ""]
  for name in sorted(flag_values):
    flag = flag_values[name]
    if name in ("help", "helpfull", "helpshort", "helpxml", "flagfile",
                "undefok"):
      continue
    default = "required" if flag.default is None else f"default {flag.default}"
    lines.append(f"  --{name}: {flag.help} ({default})")
  return "\n".join(lines)
