"""Flag parsing for the inference commands (export, generate): absl's,
with a mistake reported as one line naming the flag, exit status 2, as
`cli_errors.parse_flags` does for the main job (which also knows its
--config overrides; these commands have none)."""

from absl import flags

from dipaco_jax import cli_errors


def parse_flags(argv):
  """`app.run(..., flags_parser=parse_flags)`."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if cli_errors.wants_traceback(argv):
      raise
    cli_errors.fail(str(e).removeprefix("flag "))
